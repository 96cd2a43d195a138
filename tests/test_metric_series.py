"""Labelled counters a dashboard divides or sums exist at zero before their first event: a panel
of errors, drops or dead letters then shows 0 instead of "no data" (make test-deploy evaluates
every panel over a real run and fails on one with no series), and rate() sees the first event."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

from prometheus_client import REGISTRY

from proto.streams import PROMPTS
from services.bus import metrics as bus_metrics
from services.bus.delivery import ConsumerOptions
from services.trainer import metrics as trainer_metrics

ROOT = Path(__file__).resolve().parent.parent


def _literal_args(path: Path, function: str) -> set[str]:
    """The string constants passed last to every call of ``function`` in ``path``."""
    return {
        node.args[-1].value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", None) == function
        and isinstance(node.args[-1], ast.Constant)
    }


def _string_args(path: Path, function: str) -> set[str]:
    """The string constants passed to every call of ``function`` (a name or an attribute) in ``path``."""
    return {
        arg.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and function in (getattr(node.func, "attr", None), getattr(node.func, "id", None))
        for arg in node.args
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
    }


def _assigned(path: Path, name: str) -> set[str]:
    return {
        node.value.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == name for t in node.targets)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }


def test_the_known_reasons_are_the_reasons_the_code_uses():
    bus = ROOT / "services/bus"
    reasons = _literal_args(bus / "groups.py", "_dead_letter") | _literal_args(
        bus / "dead_lettering.py", "_dead_letter"
    )
    assert reasons == set(bus_metrics.DEAD_LETTER_REASONS)
    trainer = ROOT / "services/trainer"
    reasons = _assigned(trainer / "admission.py", "reason") | _string_args(
        trainer / "executor.py", "count_drop"
    )
    assert reasons == set(trainer_metrics.DROP_REASONS)
    for reason in trainer_metrics.DROP_REASONS:
        assert REGISTRY.get_sample_value("pbsd_trainer_dropped_groups_total", {"reason": reason}) is not None


async def test_a_consumer_exports_its_groups_counters_at_zero(bus):
    stop = asyncio.Event()
    stop.set()  # one pass: the group is made and its series registered, nothing is read
    group = f"g{id(stop)}"
    await bus.consume(
        PROMPTS, "c", lambda m: None, group=group, options=ConsumerOptions(block_ms=10), stop=stop
    )
    labels = {"stream": PROMPTS.name, "group": group}
    for name in ("processed", "duplicates", "reclaimed", "handler_errors"):
        assert REGISTRY.get_sample_value(f"pbsd_bus_{name}_total", labels) == 0.0, name
    for reason in bus_metrics.DEAD_LETTER_REASONS:
        assert REGISTRY.get_sample_value("pbsd_bus_dead_lettered_total", {**labels, "reason": reason}) == 0.0


def test_the_gateway_exports_every_tools_outcome_at_zero(tiny_world):
    from agent.catalogue import TOOLS
    from services.search.corpus import OfflineCorpus
    from services.tools.backends import OfflineBackend
    from services.tools.gateway import ToolGateway
    from services.tools.store import MemoryStore

    class Unseen(OfflineBackend):
        name = "series-check"  # a backend label no other test makes: its series exist only if made here

    corpus = OfflineCorpus.from_jsonl(tiny_world / "corpus.jsonl")
    labels = {"tool": TOOLS[0].name, "backend": Unseen.name, "outcome": "ok"}
    assert REGISTRY.get_sample_value("pbsd_tools_calls_total", labels) is None
    ToolGateway(Unseen(corpus), MemoryStore())
    for spec in TOOLS:
        for outcome in ("ok", "error"):
            labels = {"tool": spec.name, "backend": Unseen.name, "outcome": outcome}
            assert REGISTRY.get_sample_value("pbsd_tools_calls_total", labels) == 0.0
        assert (
            REGISTRY.get_sample_value("pbsd_tools_cache_total", {"tool": spec.name, "result": "hit"})
            is not None
        )


async def test_the_teachers_gauges_hold_no_figure_once_a_run_is_over(bus, key_prefix, tmp_path):
    """A GRPO step has no teacher figures, so a PBSD run's last value stayed in its gauge: for the
    next run, or for none, and the answer-free evidence alert fired for good about a run that was
    over. As any execution ends (here one whose run is gone), they are NaN: no value to alert on."""
    import math

    from services.trainer.executor import RunExecutor
    from services.trainer.runs import RunStore
    from services.trainer.settings import TrainerSettings

    trainer_metrics.ANSWER_FREE.set(-0.02)
    trainer_metrics.WRONG_DISFAVOURED.set(0.9)
    trainer_metrics.LOSS.set(0.5)
    settings = TrainerSettings(local_mode=True, stream_prefix=key_prefix, runs_dir=tmp_path)
    await RunExecutor(bus, RunStore(bus.redis, key_prefix), settings).execute("run-gone")
    assert math.isnan(REGISTRY.get_sample_value("pbsd_trainer_answer_free_evidence_mean"))
    assert math.isnan(trainer_metrics.WRONG_DISFAVOURED._value.get())
    assert trainer_metrics.LOSS._value.get() == 0.5  # a figure every run has: the next step's
