"""The JSON summary of a comparison (``summary.json``): everything the report shows, read from the
comparison's folder.

Settings, commit and machine; per run its wall and CPU time, its held-out mean@k and paired change
from the warm policy, and its teacher sanity figures; per variant mean@k with the two-level
bootstrap intervals of :mod:`pbsd.comparison`, the difference from the baseline and the change
from the warm policy; learning curves averaged over seeds with their min-max band; the teacher
sanity figures over every scored group of the variant's runs. Only finished runs (trained and
evaluated) count; the others are listed as pending.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from demo.compare import CompareConfig, label, read_json
from demo.questions import QuestionFiles
from demo.variants import VARIANTS
from pbsd.comparison import compare_variants
from proto.runs import RunSpec
from services.trainer.dynamics import sanity_metrics
from services.trainer.viewer import load_metrics

__all__ = ["CURVES", "band", "summarise"]

# the per-step figures of the trainer's metrics.jsonl drawn as learning curves (SANITY_CURVES: PBSD's only)
CURVES = ("accuracy", "reward_mean", "turns_mean")
SANITY_CURVES = ("answer_free_mean_s", "correct_final_favoured_frac", "wrong_final_disfavoured_frac")
ROOT = Path(__file__).resolve().parent.parent


def band(series: list[dict[int, float]]) -> dict[str, list[float]]:
    """Runs' per-step values (step -> value, one mapping a run) as the mean over the runs that have
    the step, with the least and largest of them: ``{"steps", "mean", "min", "max", "runs"}``."""
    steps = sorted({s for run in series for s in run})
    values = [[run[s] for run in series if s in run] for s in steps]
    return {
        "steps": steps,
        "mean": [float(np.mean(v)) for v in values],
        "min": [float(np.min(v)) for v in values],
        "max": [float(np.max(v)) for v in values],
        "runs": [len(v) for v in values],
    }


def commit() -> dict[str, Any]:
    """The checkout's commit and whether it had uncommitted changes (None outside a git checkout)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"sha": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def machine() -> dict[str, Any]:
    import torch

    info = Path("/proc/cpuinfo")
    models = [x for x in info.read_text().splitlines() if x.startswith("model name")] if info.exists() else []
    cpu = models[0].split(":", 1)[1].strip() if models else platform.processor()
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _sanity(groups: list) -> dict[str, float]:
    scored = [g for g in groups if g.scored]
    return sanity_metrics(scored) if scored else {}


def _run(result: dict[str, Any], evaluation: dict[str, Any], k: int) -> dict[str, Any]:
    return {
        "variant": result["variant"],
        "seed": result["seed"],
        "run_id": result["run_id"],
        "steps": int(result["record"]["step"]),
        "train": result["train"],
        "eval": result["eval"],
        f"mean@{k}": evaluation["accuracy"]["all"][f"mean@{k}"],
        "change": evaluation["change"],
        "finish_reasons": evaluation["finish_reasons"],
        "mean_turns": evaluation["mean_turns"],
        "grounding": evaluation["grounding"],
    }


def summarise(
    config: CompareConfig, out: Path, questions: QuestionFiles, *, seconds: float
) -> dict[str, Any]:
    """The summary of what ``out`` holds for ``config``'s variants and seeds."""
    from services.trainer.viewer import load_groups

    k = config.demo.eval_samples
    ids = [json.loads(x)["id"] for x in questions.evaluation.read_text().splitlines()]
    before = read_json(out / "evals" / "eval-before.json")

    def per_question(report: dict[str, Any]) -> list[float]:
        return [float(np.mean(report["per_question"][q]["correct"])) for q in ids]

    runs, pending = [], []
    matrices: dict[str, list[list[float]]] = {}
    seeds: dict[str, list[int]] = {}
    curves: dict[str, dict[str, dict[str, list[float]]]] = {}
    sanity: dict[str, dict[str, float]] = {}
    algorithms: dict[str, dict[str, Any]] = {}
    for variant in config.variants:
        series: dict[str, list[dict[int, float]]] = {}
        groups: list = []
        for seed in config.seeds:
            result = read_json(out / "results" / f"{label(variant, seed)}.json") or {}
            evaluation = read_json(out / "evals" / f"eval-{label(variant, seed)}.json")
            if not result.get("eval") or evaluation is None:
                pending.append(label(variant, seed))
                continue
            run_dir = Path(result["run_dir"])
            run_groups = [g for _, g in load_groups(run_dir)]
            groups += run_groups
            runs.append(_run(result, evaluation, k) | {"sanity": _sanity(run_groups)})
            matrices.setdefault(variant, []).append(per_question(evaluation))
            seeds.setdefault(variant, []).append(seed)
            algorithms[variant] = RunSpec.model_validate(result["spec"]).algorithm.model_dump(mode="json")
            metrics = load_metrics(run_dir)
            for key in CURVES + SANITY_CURVES:
                points = {int(r["step"]): r[key] for r in metrics if key in r}
                if points:
                    series.setdefault(key, []).append(points)
        if variant in matrices:
            curves[variant] = {key: band(s) for key, s in series.items()}
            sanity[variant] = _sanity(groups)
    baseline = config.baseline if config.baseline in matrices else None
    statistics = (
        compare_variants(
            matrices,
            seeds=seeds,
            baseline=baseline,
            before=per_question(before) if before is not None else None,
            resamples=config.resamples,
            seed=config.bootstrap_seed,
        )
        if matrices
        else None
    )
    return {
        "settings": config.model_dump(mode="json"),
        "commit": commit(),
        "machine": machine(),
        "seconds": seconds,
        "eval_samples": k,
        "questions": {
            "train": questions.train_questions,
            "evaluation": questions.evaluation_questions,
            "difficulty": list(config.demo.difficulty),
        },
        "variants": {
            v: {"summary": VARIANTS[v].summary, "algorithm": algorithms.get(v)} for v in config.variants
        },
        "before": None
        if before is None
        else {
            f"mean@{k}": before["accuracy"]["all"][f"mean@{k}"],
            "finish_reasons": before["finish_reasons"],
            "mean_turns": before["mean_turns"],
            "grounding": before["grounding"],
            "eval": (read_json(out / "results" / "before.json") or {}).get("eval"),
        },
        "statistics": statistics,
        "runs": runs,
        "pending": pending,
        "curves": curves,
        "curve_band": "min-max over the seeds that reached the step",
        "sanity": sanity,
    }
