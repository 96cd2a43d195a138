"""``pbsd demo``: train a search agent end to end on one machine, and show what PBSD did.

    1. build the embedded world                                   (seeded: the same world every time)
    2. the warmed-up tiny policy: the committed one, or built here (oracle SFT data,
       a tokenizer and a tiny Qwen3-MoE, SFT and the passes after it) with --from-scratch
       (demo/warm_start.py)
    3. a private Redis and the four services as separate processes, each started as in
       production (pbsd serve tools | scorer | rollout | trainer) and health-checked
    4. evaluate the warm policy; submit the run through the trainer's REST API and follow
       it; evaluate the trained policy (and the same for GRPO with --algorithm both)
    5. write the report: report.html with figures, metrics JSONL, the credit viewer

Every process is stopped on success, failure or Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from agent.grounding import describe
from demo.config import DemoConfig
from demo.progress import say
from demo.questions import question_files
from demo.warm_start import prepare_policy
from pbsd.accuracy import describe_change
from services.launcher import ServiceProcess, sigterm_as_interrupt
from services.local_redis import LocalRedis, free_port
from services.rollout.agent import AgentLimits
from services.rollout.runner import eval_main
from worldgen.build import build_world, world_fingerprint

__all__ = ["run_demo"]


def evaluate(
    config: DemoConfig,
    policy: Path,
    questions: Path,
    world: Path,
    label: str,
    out: Path,
    before: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Evaluate ``policy`` on ``questions`` into ``eval-<label>.json``; with ``before`` (the
    evaluation before training) it holds the paired change from it as well."""
    n = sum(1 for _ in questions.read_text().splitlines()) * config.eval_samples
    bar = tqdm(total=n, desc=f"evaluate {label}", unit="traj")
    limits = AgentLimits(
        max_turns=config.max_turns,
        max_tokens_per_turn=config.max_tokens_per_turn,
        max_context=config.max_context,
        top_p=config.eval_top_p,
    )

    import torch

    torch.set_num_threads(config.torch_threads)
    report = asyncio.run(
        eval_main(
            policy,
            questions,
            samples=config.eval_samples,
            corpus=world / "corpus.jsonl",
            tools_url=None,
            sglang_urls=[],
            limit=None,
            limits=limits,
            concurrency=config.eval_concurrency,
            # the world's "today", as in the warm start's trajectories and the training rollouts:
            # the calendar's would make the samples depend on the day the demo runs
            date=json.loads((world / "manifest.json").read_text())["date"],
            seed=config.seed,
            on_done=lambda: bar.update(1),
            before=before,
        )
    )
    bar.close()
    (out / f"eval-{label}.json").write_text(json.dumps(report, indent=2))
    acc = report["accuracy"]["all"][f"mean@{config.eval_samples}"]
    change = f", change {describe_change(report['change'])}" if before is not None else ""
    say(
        f"{label}: accuracy {acc:.3f} on {report['questions']} questions{change}, finish reasons "
        f"{report['finish_reasons']}, {describe(report['grounding'])}"
    )
    return report


def run_spec(config: DemoConfig, algorithm: str, policy: Path, rl: Path, questions: int) -> dict[str, Any]:
    """The run the demo submits. ``questions`` (how many ``rl`` holds) sets enough epochs over
    them for every step plus one step of replacements for groups the trainer drops."""
    needed = (config.steps + 1) * config.prompts_per_step
    return {
        "name": f"demo-{algorithm}",
        "model": {"path": str(policy), "dtype": "float32"},
        "data": {"train": str(rl), "shuffle_seed": config.seed, "epochs": -(-needed // questions)},
        "rollout": {
            "group_size": config.group_size,
            "max_turns": config.max_turns,
            "max_tokens_per_turn": config.max_tokens_per_turn,
            "max_context": config.max_context,
            "max_staleness": config.max_staleness,
            "temperature": 1.0,
            "top_p": 1.0,
        },
        # the teacher template matters to PBSD alone; GRPO's spec stays the paper's (pbsd compare
        # builds its variants over the GRPO spec, so its "pbsd" is the paper's default wording)
        "algorithm": {"name": algorithm}
        | ({"teacher_template": config.teacher_template} if algorithm == "pbsd" else {}),
        "trainer": {
            "prompts_per_step": config.prompts_per_step,
            "updates_per_step": config.updates_per_step,
            "max_steps": config.steps,
            "lr": config.lr,
            "warmup_steps": config.warmup_steps,
            "checkpoint_every": config.steps,
            "seed": config.seed,
        },
    }


def submit_run(api: httpx.Client, spec: dict[str, Any]) -> str:
    """Submit a run spec through the trainer's REST API; its run id."""
    return api.post("/runs", json=spec).raise_for_status().json()["id"]


def follow_run(
    api: httpx.Client,
    run_id: str,
    steps: int,
    label: str,
    services: list[ServiceProcess],
    stall_timeout_s: float,
) -> dict[str, Any]:
    """Poll the run until it ends; raise if a service dies or no step comes for ``stall_timeout_s``
    (a pipeline that stopped moving must fail the demo, not hang it)."""
    bar = tqdm(total=steps, desc=f"train {label}", unit="step")
    seen, progressed = 0, time.monotonic()
    while True:
        for service in services:
            service.check_alive()
        record = api.get(f"/runs/{run_id}").raise_for_status().json()
        if record["step"] > seen:
            progressed = time.monotonic()
            bar.update(record["step"] - seen)
            seen = record["step"]
            m = record["latest_metrics"]
            bar.set_postfix(
                acc=f"{m.get('accuracy', 0):.2f}",
                turns=f"{m.get('turns_mean', 0):.1f}",
                stale=f"{m.get('staleness_mean', 0):.1f}",
            )
        if record["state"] in ("completed", "failed", "cancelled"):
            bar.close()
            if record["state"] != "completed":
                raise RuntimeError(f"run {run_id} ended {record['state']}: {record.get('error')}")
            return record
        if time.monotonic() - progressed > stall_timeout_s:
            bar.close()
            raise RuntimeError(
                f"run {run_id} stalled: no training step for {stall_timeout_s:.0f}s after step {seen} "
                f"(state {record['state']}); see the services' logs in {services[0].log.parent}"
            )
        time.sleep(1.0)


def prepare_world(config: DemoConfig, out: Path) -> tuple[Path, dict[str, Any]]:
    """The world in ``out/world`` (built there unless an earlier demo built it with these very
    settings) and its manifest."""
    world = out / "world"
    if not (world / "manifest.json").exists():
        build_world(
            world,
            seed=config.seed,
            entities=config.entities,
            n_rl=config.n_rl,
            n_val=config.n_val,
            n_sft=config.n_sft,
        )
    asked = {k: getattr(config, k) for k in ("seed", "entities", "n_rl", "n_val", "n_sft")}
    made = world / "demo-world.json"  # what the demo asked for when it built this world
    built_for = json.loads(made.read_text()) if made.exists() else asked
    if built_for != asked:
        # a world left in --out by an earlier demo with other settings: never train on it silently
        raise SystemExit(
            f"{world} was built for {built_for}, not for {asked}; use another --out or delete that folder"
        )
    made.write_text(json.dumps(asked))
    manifest = json.loads((world / "manifest.json").read_text())
    say(f"world: {config.entities} entities, questions {manifest['questions']}")
    return world, manifest


def start_services(
    stack: contextlib.ExitStack, config: DemoConfig, world: Path, policy: Path, out: Path, token: str
) -> list[ServiceProcess]:
    """A private Redis and the four services, tools, scorer, rollout and trainer (last), started,
    healthy, and stopped when ``stack`` closes; the trainer's REST API takes ``token`` and keeps
    its runs in ``out/runs``."""
    redis_server = stack.enter_context(LocalRedis(workdir=out / "redis", persist=False))
    common = {
        "REDIS_URL": redis_server.url,
        "PBSD_STREAM_PREFIX": "demo",
        "PBSD_LOG_LEVEL": "INFO",
        "OMP_NUM_THREADS": str(config.torch_threads),  # torch's intra-op threads at import
        "MKL_NUM_THREADS": str(config.torch_threads),
    }
    logs = out / "logs"
    services = [
        ServiceProcess(
            "tools",
            port=free_port(),
            log=logs / "tools.log",
            env={**common, "PBSD_TOOLS_CORPUS": str(world / "corpus.jsonl")},
        ),
        ServiceProcess(
            "scorer",
            port=free_port(),
            log=logs / "scorer.log",
            env={**common, "PBSD_SCORER_MODEL": str(policy), "PBSD_SCORER_SHUTDOWN_GRACE_S": "10"},
        ),
    ]
    tools_url = services[0].url
    services.append(
        ServiceProcess(
            "rollout",
            port=free_port(),
            log=logs / "rollout.log",
            env={
                **common,
                "PBSD_ROLLOUT_MODEL": str(policy),
                "PBSD_ROLLOUT_TOOLS_URL": tools_url,
                "PBSD_ROLLOUT_CONCURRENCY": str(config.rollout_concurrency),
                "PBSD_ROLLOUT_DATE": json.loads((world / "manifest.json").read_text())["date"],
                "PBSD_ROLLOUT_SEED": str(config.seed),
                "PBSD_ROLLOUT_SHUTDOWN_GRACE_S": "10",
            },
        )
    )
    services.append(
        ServiceProcess(
            "trainer",
            port=free_port(),
            log=logs / "trainer.log",
            env={
                **common,
                "PBSD_TRAINER_API_TOKEN": token,
                "PBSD_TRAINER_RUNS_DIR": str(out / "runs"),
                # the run specs name the questions and the policy under out/, and nothing else
                "PBSD_TRAINER_DATA_ROOTS": json.dumps([str(out)]),
                "PBSD_TRAINER_MODEL_ROOTS": json.dumps([str(out)]),
                "PBSD_TRAINER_SAVE_GROUPS": "1",
                # nothing here outlives the demo: a stop need not wait for a step to finish
                "PBSD_TRAINER_SHUTDOWN_GRACE_S": "10",
            },
        )
    )
    for service in tqdm(services, desc="start services", unit="service"):
        stack.callback(service.stop)
        service.start()
    for service in services:
        service.wait_healthy(timeout=600)
    say("services up: " + ", ".join(f"{s.name} {s.url}" for s in services) + f" (logs in {logs})")
    return services


def run_demo(config: DemoConfig, out: Path) -> dict[str, Any]:
    with sigterm_as_interrupt():  # `kill` stops the services as Ctrl-C does
        return _run_demo(config, out)


def _run_demo(config: DemoConfig, out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    out = out.absolute()  # the services and Redis get paths under it, whatever their working directory
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo-config.json").write_text(json.dumps(config.settings_used(), indent=2))
    say(f"output in {out}")
    world, manifest = prepare_world(config, out)
    # the world's fingerprint tells whether the committed policy was supervised on this very world
    policy = prepare_policy(config, world, world_fingerprint(manifest), out)
    questions = question_files(config, world, out / "data")
    algorithms = ["pbsd", "grpo"] if config.algorithm == "both" else [config.algorithm]

    evals = {"before": evaluate(config, policy, questions.evaluation, world, "before", out)}
    runs: dict[str, dict[str, Any]] = {}
    token = secrets.token_urlsafe(24)
    with contextlib.ExitStack() as stack:
        services = start_services(stack, config, world, policy, out, token)
        trainer = services[-1]
        with httpx.Client(
            base_url=trainer.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
        ) as api:
            for algorithm in algorithms:
                spec = run_spec(config, algorithm, policy, questions.train, questions.train_questions)
                run_id = submit_run(api, spec)
                say(f"submitted {algorithm} run {run_id}")
                record = follow_run(api, run_id, config.steps, algorithm, services, config.stall_timeout_s)
                runs[algorithm] = {"id": run_id, "dir": str(out / "runs" / run_id), "record": record}
                evals[f"after-{algorithm}"] = evaluate(
                    config,
                    out / "runs" / run_id / "final",
                    questions.evaluation,
                    world,
                    f"after-{algorithm}",
                    out,
                    before=evals["before"],
                )
    from demo.report import write_report

    report = write_report(out, config, runs, evals, elapsed=time.perf_counter() - started)
    return {
        "out": str(out),
        "report": str(report),
        "runs": runs,
        "evals": evals,
        "seconds": time.perf_counter() - started,
    }
