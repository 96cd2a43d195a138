"""``pbsd compare``: K seeds x variants trained on one world from one warm policy, each evaluated
on the same held-out questions, compared with intervals that count run-to-run variance.

    1. the demo's world and warm policy (demo/run.py: the committed policy, ``--policy``, or one
       built from scratch), the world's RL questions of the demo's difficulties to train on, and
       ``eval_questions`` of the world's reserve to evaluate on (demo/questions.py, ``reserve``:
       pool questions no split holds, of the same difficulties, no hop path shared)
    2. the warm policy evaluated once
    3. a private Redis and the four services started once (demo/run.py, ``start_services``); for
       every variant (demo/variants.py) and seed a run submitted through the trainer's REST API,
       one after another, and its final policy evaluated on the same questions with the same
       sampling seeds as the warm policy (paired)
    4. the statistics (pbsd/comparison.py), ``summary.json`` and ``report.html``
       (demo/compare_summary.py, demo/compare_report.py)

Seed s of every variant runs with ``trainer.seed`` and ``data.shuffle_seed`` s. Resumable: each
run's progress is kept in ``results/<variant>-s<seed>.json``; run again with the same ``--out``
and what finished is skipped, a run trained but not evaluated is only evaluated, and a run
interrupted in training starts again (its partial folder removed). Adding variants or seeds
to a finished comparison runs only the new ones. Settings that change what a run computes
must stay the same (refused otherwise).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from demo.config import DemoConfig
from demo.progress import say
from demo.questions import QuestionFiles, reserve_files
from demo.run import evaluate, follow_run, prepare_world, run_spec, start_services, submit_run
from demo.variants import VARIANTS, variant_spec
from demo.warm_start import prepare_policy
from pbsd.comparison import DEFAULT_RESAMPLES
from services.launcher import ServiceProcess, sigterm_as_interrupt
from worldgen.build import world_fingerprint

__all__ = ["CompareConfig", "run_compare"]

# demo settings that change how long a comparison takes, not what its runs compute: a resumed
# comparison may change them (algorithm and the eval_split settings are the demo's own, unused here)
FREE = (
    "stall_timeout_s",
    "torch_threads",
    "eval_concurrency",
    "rollout_concurrency",
    "algorithm",
    "eval_split",
    "eval_difficulty",
)


class CompareConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    demo: DemoConfig = Field(description="the world, warm policy, run sizes and evaluation settings")
    variants: list[str] = Field(default=["grpo", "pbsd"], min_length=1)
    seeds: list[int] = Field(default=[0, 1, 2], min_length=1)
    baseline: str = Field(default="grpo", description="the variant every other is compared against")
    resamples: int = Field(default=DEFAULT_RESAMPLES, ge=1)
    bootstrap_seed: int = 0

    @model_validator(mode="after")
    def _known(self):
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown variants {unknown}; the variants are {', '.join(VARIANTS)}")
        if len(set(self.variants)) != len(self.variants) or len(set(self.seeds)) != len(self.seeds):
            raise ValueError("variants and seeds must not repeat")
        if self.baseline not in self.variants:
            raise ValueError(f"the baseline {self.baseline!r} is not among the variants {self.variants}")
        return self

    def labels(self) -> list[tuple[str, int]]:
        return [(v, s) for v in self.variants for s in self.seeds]


def label(variant: str, seed: int) -> str:
    return f"{variant}-s{seed}"


def _write_atomic(path: Path, data: Any) -> None:
    """JSON written so that an interruption leaves the old file or the new one, never half of one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def read_json(path: Path) -> Any | None:
    """A JSON file's content; None when missing or unreadable (a write cut short)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def check_resume(config: CompareConfig, out: Path, *, record: bool = True) -> None:
    """Refuse an ``out`` whose earlier comparison computed its runs with other settings; then,
    with ``record``, keep ``config`` as the comparison's."""
    path = out / "compare-config.json"
    earlier = read_json(path)
    if earlier is not None:
        old = DemoConfig(**earlier["demo"]).model_dump(exclude=set(FREE))
        new = config.demo.model_dump(exclude=set(FREE))
        changed = {k: (old[k], new[k]) for k in new if old[k] != new[k]}
        if changed:
            raise SystemExit(
                f"{out} holds a comparison made with other settings ("
                + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())
                + "); use another --out, or the same settings to resume it"
            )
    if record:
        _write_atomic(path, config.model_dump(mode="json"))


def run_compare(config: CompareConfig, out: Path, *, report_only: bool = False) -> dict[str, Any]:
    """Train and evaluate what ``out`` does not hold yet (nothing with ``report_only``), then
    write ``summary.json`` and ``report.html``; the summary."""
    with sigterm_as_interrupt():  # `kill` stops the services as Ctrl-C does
        return _run_compare(config, out, report_only)


def _run_compare(config: CompareConfig, out: Path, report_only: bool) -> dict[str, Any]:
    from demo.compare_report import write_report
    from demo.compare_summary import summarise

    started = time.perf_counter()
    out = out.absolute()  # the services get paths under it, whatever their working directory
    out.mkdir(parents=True, exist_ok=True)
    say(f"output in {out}")
    if report_only:  # beside a comparison still running: read its files, write none of them
        check_resume(config, out, record=False)
        questions = _written_questions(out / "data")
    else:
        check_resume(config, out)
        world, manifest = prepare_world(config.demo, out)
        policy = out / "policy-sft"
        if not (policy / "config.json").exists():  # check_resume holds a kept policy to these settings
            policy = prepare_policy(config.demo, world, world_fingerprint(manifest), out)
        questions = reserve_files(config.demo, world, out / "data")
        say(
            f"{questions.train_questions} RL questions to train on, {questions.evaluation_questions} "
            f"held-out questions x {config.demo.eval_samples} samples to evaluate on"
        )
        _train_and_evaluate(config, out, world, policy, questions)
    summary = summarise(config, out, questions, seconds=time.perf_counter() - started)
    _write_atomic(out / "summary.json", summary)
    summary["report"] = str(write_report(summary, out))
    return summary


def _written_questions(data: Path) -> QuestionFiles:
    """The question files an earlier invocation wrote into ``data``."""
    train, held = data / "train.jsonl", data / "reserve.jsonl"
    if not (train.exists() and held.exists()):
        raise SystemExit(f"{data.parent} holds no comparison to report on (no {held})")
    count = [len(f.read_text().splitlines()) for f in (train, held)]
    return QuestionFiles(train, held, count[0], count[1])


def _train_and_evaluate(
    config: CompareConfig, out: Path, world: Path, policy: Path, questions: QuestionFiles
) -> None:
    evals = out / "evals"
    evals.mkdir(exist_ok=True)
    (out / "results").mkdir(exist_ok=True)
    before = read_json(evals / "eval-before.json")
    if before is None:
        before, timing = _timed(
            lambda: evaluate(config.demo, policy, questions.evaluation, world, "before", evals)
        )
        _write_atomic(out / "results" / "before.json", {"eval": timing})
    todo = [(v, s) for v, s in config.labels() if stage(read_json(_result(out, v, s)) or {}) != "done"]
    say(f"{len(config.labels()) - len(todo)} of {len(config.labels())} runs done; {len(todo)} to go")
    token = secrets.token_urlsafe(24)
    with contextlib.ExitStack() as stack:
        api: httpx.Client | None = None
        services: list[ServiceProcess] = []
        for variant, seed in todo:
            result = read_json(_result(out, variant, seed)) or {}
            if stage(result) == "train":
                if api is None:  # services start once, for the first run that trains
                    services = start_services(stack, config.demo, world, policy, out, token)
                    api = stack.enter_context(
                        httpx.Client(
                            base_url=services[-1].url,
                            headers={"Authorization": f"Bearer {token}"},
                            timeout=30,
                        )
                    )
                result = _train(config, out, api, services, variant, seed, policy, questions, result)
            _evaluate(config, out, world, questions, before, result)


def stage(result: dict[str, Any]) -> str:
    """What a run still needs, by its results file (``{}`` when it has none): ``"done"`` (trained
    and evaluated), ``"evaluate"`` (trained, its final checkpoint on disk) or ``"train"``."""
    if result.get("eval"):
        return "done"
    if result.get("train") and (Path(result["run_dir"]) / "final" / "config.json").exists():
        return "evaluate"
    return "train"


def trained_runs(out: Path, variant: str) -> tuple[list[Path], int]:
    """The run folders of ``variant``'s trained seeds in the comparison ``out``, and how many seeds
    it has a results file for. A run counts once trained: one cut short keeps only some steps'
    groups. ``pbsd-x`` does not take ``pbsd-x-no-deadband``'s seeds."""
    pattern = re.compile(re.escape(variant) + r"-s\d+\.json")
    results = [p for p in sorted((out / "results").glob("*.json")) if pattern.fullmatch(p.name)]
    trained = [r["run_id"] for p in results if (r := json.loads(p.read_text())).get("train")]
    return [out / "runs" / run for run in trained], len(results)


def _result(out: Path, variant: str, seed: int) -> Path:
    return out / "results" / f"{label(variant, seed)}.json"


def _train(
    config: CompareConfig,
    out: Path,
    api: httpx.Client,
    services: list[ServiceProcess],
    variant: str,
    seed: int,
    policy: Path,
    questions: QuestionFiles,
    earlier: dict[str, Any],
) -> dict[str, Any]:
    """One training run of ``variant`` with ``seed``, recorded in its results file."""
    if earlier.get("run_dir"):  # a run cut short by an earlier interruption: start it again
        shutil.rmtree(earlier["run_dir"], ignore_errors=True)
    seeded = config.demo.model_copy(update={"seed": seed})
    base = run_spec(seeded, "grpo", policy, questions.train, questions.train_questions)
    spec = variant_spec(variant, base | {"name": f"compare-{label(variant, seed)}"})
    cpu = [s.cpu_seconds() for s in services]
    started = time.perf_counter()
    run_id = submit_run(api, spec)
    result = {"variant": variant, "seed": seed, "run_id": run_id, "run_dir": str(out / "runs" / run_id)}
    _write_atomic(_result(out, variant, seed), result)
    say(f"submitted {label(variant, seed)}: run {run_id}")
    record = follow_run(
        api, run_id, config.demo.steps, label(variant, seed), services, config.demo.stall_timeout_s
    )
    used = [
        None if a is None or b is None else b - a
        for a, b in zip(cpu, (s.cpu_seconds() for s in services), strict=True)
    ]
    result |= {
        "spec": spec,
        "record": record,
        "train": {
            "wall_s": time.perf_counter() - started,
            # the services' own CPU time over the run (None where /proc cannot tell)
            "cpu_s": {s.name: u for s, u in zip(services, used, strict=True)},
            "loadavg": list(_loadavg()),
        },
    }
    _write_atomic(_result(out, variant, seed), result)
    return result


def _evaluate(
    config: CompareConfig,
    out: Path,
    world: Path,
    questions: QuestionFiles,
    before: dict[str, Any],
    result: dict[str, Any],
) -> None:
    """The run's final policy on the held-out questions, with the warm policy's sampling seeds."""
    name = label(result["variant"], result["seed"])
    final = Path(result["run_dir"]) / "final"
    _, timing = _timed(
        lambda: evaluate(config.demo, final, questions.evaluation, world, name, out / "evals", before=before)
    )
    _write_atomic(_result(out, result["variant"], result["seed"]), result | {"eval": timing})


def _timed(work: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """``work()`` and what it took: wall time, this process's CPU time (an evaluation's in-process
    engine decodes here) and the machine's load averages after it."""
    started, cpu = time.perf_counter(), time.process_time()
    value = work()
    return value, {
        "wall_s": time.perf_counter() - started,
        "cpu_s": time.process_time() - cpu,
        "loadavg": list(_loadavg()),
    }


def _loadavg() -> tuple[float, float, float]:
    """The machine's load averages (how busy its other jobs kept it), or zeros where unknown."""
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)
