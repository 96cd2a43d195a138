"""Rollout speed on this machine.

1. The agent loop's own overhead per turn: an engine that answers instantly with a
   scripted tool call (8 turns, then an answer), the tool gateway over HTTP on loopback
   (offline backend, private Redis) beside the same gateway in process, and the group
   published on the bus; one group at a time, and as many at once as a rollout worker
   samples with its default settings. Figure: turns/s per worker.
2. The in-process engine's generation speed on the tiny Qwen3-MoE model, multi-turn
   (the prompt, then 6 turns of 48 tokens with tool-result glue and a 2 ms tool call
   between them): a group of 8 trajectories at once, continuously batched, against the
   same group served one request at a time (the goal: 3x); one trajectory after another,
   with and without KV-cache reuse across turns.

The agent loop runs on uvloop, as the rollout service does (uvicorn picks it).

Run: ``.venv/bin/python benchmarks/rollout.py [--threads N]`` (torch's intra-op threads for the
engine part; default: torch's own choice, the cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
import uvloop

from agent.catalogue import catalogue
from agent.chat import ChatTokenizer
from agent.prompt import system_prompt, user_prompt
from agent.toolcall import format_tool_call
from proto.messages import PromptTask
from proto.runs import PbsdSpec, RolloutSpec
from proto.streams import TRAJECTORIES
from services.bus import Bus
from services.launcher import ServiceProcess
from services.local_redis import LocalRedis, free_port
from services.model.checkpoint import save_checkpoint
from services.model.tiny import TinySpec, build_tiny_model, train_tokenizer
from services.rollout.engine import GenerationRequest, GenerationResult
from services.rollout.inprocess import InProcessEngine
from services.rollout.runner import local_tools
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker
from services.tools.client import GatewayClient
from worldgen.build import build_world

# groups a rollout worker samples at once with its default settings
SERVICE_CONCURRENCY = RolloutSettings.model_fields["concurrency"].default


class InstantEngine:
    """Answers at once: ``turns - 1`` searches, then a boxed answer (a harness, not a model)."""

    def __init__(self, tok: ChatTokenizer, turns: int) -> None:
        self.weight_version = 0
        self.call = tok.encode(
            "Let me search.\n\n"
            + format_tool_call(
                "search_and_scrape_webpage", "google_search", {"q": "river festival", "num": 5}
            )
        ) + [tok.end_id]
        self.answer = tok.encode("\\boxed{Danube}") + [tok.end_id]
        self.turns = turns
        self.calls: dict[str | None, int] = {}  # turns answered per trajectory

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        n = self.calls[request.session] = self.calls.get(request.session, 0) + 1
        out = self.answer if n >= self.turns else self.call
        return GenerationResult(out, [-0.1] * len(out), "stop", 0)

    async def update_weights(self, path, version, timeline=""):
        self.weight_version = version

    async def health(self):
        return True

    async def aclose(self):
        return None


async def loop_overhead(
    tok: ChatTokenizer, tools, bus: Bus, *, groups: int, group_size: int, turns: int, at_once: int = 1
) -> tuple[float, float]:
    """Turns per second, and this process's CPU milliseconds a turn (the gateway's own process
    not included), with ``at_once`` groups sampled at the same time (a rollout worker's
    ``concurrency``)."""
    engine = InstantEngine(tok, turns)
    worker = RolloutWorker(bus, engine, tools, tok, date="2025-06-01")
    worker.system = system_prompt(catalogue(), "2025-06-01")
    slots = asyncio.Semaphore(at_once)

    async def one_group(i: int) -> None:
        task = PromptTask(
            run_id="b",
            task_id=f"b:{i}",
            question_id="q",
            question="Which river?",
            answer="Danube",
            index=i,
            algorithm=PbsdSpec(),
            rollout=RolloutSpec(group_size=group_size, max_turns=turns + 1),
        )
        async with slots:
            group = await worker.sample_group(task)
            await bus.publish(TRAJECTORIES, group)
        assert all(t.num_turns == turns for t in group.trajectories)

    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one_group(i) for i in range(groups)))
    n = groups * group_size * turns
    return n / (time.perf_counter() - start), 1000 * (time.process_time() - cpu) / n


async def engine_speed(
    model,
    tok: ChatTokenizer,
    *,
    trajectories: int,
    together: bool,
    same_question: bool = False,
    turns: int = 6,
    tokens: int = 48,
    tool_s: float = 0.002,
    **engine_options,
) -> tuple[float, float, float]:
    """Generated tokens per second of wall time and per second of this process's CPU time for ``trajectories`` trajectories of ``turns`` turns of ``tokens`` tokens,
    with tool-result glue and a ``tool_s`` pause (the tool call) between turns: all at once
    (``together``) or one after another, of one question (``same_question``: a group's samples,
    which share the prompt's cache) or each of its own; and the mean decode batch. CPU time is
    the steadier figure on a shared machine: other work stretches wall time, not CPU time."""
    engine = InProcessEngine(model, **engine_options)
    system = system_prompt(catalogue(), "2025-06-01")
    glue_text = json.dumps({"organic": [{"title": "A result", "snippet": "text " * 40}]})
    generated = 0

    async def trajectory(k: int) -> None:
        nonlocal generated
        ids = tok.prompt_ids(system, user_prompt(f"Question number {0 if same_question else k}?"))
        for t in range(turns):
            r = await engine.generate(GenerationRequest(ids, tokens, seed=k * 100 + t, session=f"t{k}"))
            generated += len(r.output_ids)
            await asyncio.sleep(tool_s)
            ids = ids + r.output_ids + tok.glue_ids(glue_text, closed=False)
        engine.forget(f"t{k}")

    start, cpu = time.perf_counter(), time.process_time()
    if together:
        await asyncio.gather(*(trajectory(k) for k in range(trajectories)))
    else:
        for k in range(trajectories):
            await trajectory(k)
    speed, per_cpu = generated / (time.perf_counter() - start), generated / (time.process_time() - cpu)
    await engine.aclose()
    return speed, per_cpu, engine.decoded_rows / max(engine.decode_steps, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__} with {torch.get_num_threads()} intra-op threads"
    )
    with tempfile.TemporaryDirectory() as tmp:
        world = Path(tmp) / "world"
        build_world(world, seed=0, entities=2000, n_rl=50, n_val=20, n_sft=20)
        texts = [json.loads(line)["text"] for line in (world / "corpus.jsonl").read_text().splitlines()]
        tokenizer = train_tokenizer([*texts, system_prompt(catalogue(), "2025-06-01")], 4096)
        model = build_tiny_model(tokenizer, TinySpec())
        ckpt = save_checkpoint(model, Path(tmp) / "tiny", tokenizer=tokenizer)
        tok = ChatTokenizer.from_pretrained(ckpt)

        with LocalRedis() as redis_server:
            env = {
                "REDIS_URL": redis_server.url,
                "PBSD_TOOLS_CORPUS": str(world / "corpus.jsonl"),
                "PBSD_LOG_LEVEL": "WARNING",
            }
            with ServiceProcess("tools", port=free_port(), env=env) as gateway:

                async def loops():
                    bus = Bus.from_url(redis_server.url, prefix="bench")
                    http_tools = GatewayClient(gateway.url)
                    local = local_tools(world / "corpus.jsonl")
                    out = {}
                    for name, tools in (("over HTTP", http_tools), ("in process", local)):
                        for at_once in (1, SERVICE_CONCURRENCY):
                            out[name, at_once] = await loop_overhead(
                                tok, tools, bus, groups=8, group_size=8, turns=8, at_once=at_once
                            )
                    await http_tools.aclose()
                    await bus.close()
                    return out

                loops = uvloop.run(loops())
        print("\n1. agent-loop overhead (instant engine; parse, bookkeeping, tool call, bus publish)")
        print(f"   {'':56} {'turns/s':>8} {'CPU ms/turn':>12} {'baseline':>9} {'goal':>6} {'CPU budget':>11}")
        for (where, at_once), (figure, ms) in loops.items():
            name = (
                "tools over HTTP (gateway service, Redis cache)"
                if where == "over HTTP"
                else "tools in process (no HTTP)"
            ) + (", 1 group" if at_once == 1 else f", {at_once} groups")
            recorded, goal = (256, 1000) if where == "over HTTP" else (626, 2000)
            print(f"   {name:56} {figure:8.0f} {ms:12.2f} {recorded:9} {goal:6} {1000 / goal:11.2f}")
        print(
            "   (baseline: turns/s recorded 2026-11-22, one group at a time; a rollout worker samples\n"
            f"   {SERVICE_CONCURRENCY} groups at once by default (PBSD_ROLLOUT_CONCURRENCY); CPU: the agent loop's\n"
            "   own process, which runs on one core: CPU budget is the ms a turn that reaches the goal;\n"
            "   the gateway has the other core)"
        )

        prompt_tokens = len(tok.prompt_ids(system_prompt(catalogue(), "2025-06-01"), "q"))
        print(
            "\n2. in-process engine, tiny Qwen3-MoE (2 layers, 8 experts), trajectories of 6 turns x 48 tokens "
            f"after a {prompt_tokens}-token prompt, a 2 ms tool call between turns"
        )
        group = {}
        for name, options in (("ours", {}), ("one request at a time", {"max_batch": 1})):
            group[name] = asyncio.run(
                engine_speed(model, tok, trajectories=8, together=True, same_question=True, **options)
            )
        alone = asyncio.run(engine_speed(model, tok, trajectories=4, together=False))
        no_reuse = asyncio.run(engine_speed(model, tok, trajectories=4, together=False, reuse_cache=False))
        ours, baseline = group["ours"], group["one request at a time"]
        rows = [
            ("a group of 8 samples at once, batched (ours)", ours),
            ("the same group, one request at a time (baseline)", baseline),
            ("one trajectory after another, KV cache reused", alone),
            ("one after another, every turn re-reads the context", no_reuse),
        ]
        print(f"   {'':52} {'tokens/s':>9} {'tokens/CPU-s':>13}")
        for name, (wall, per_cpu, _) in rows:
            print(f"   {name:52} {wall:9.0f} {per_cpu:13.0f}")
        print(f"   {'mean rows per batched decode forward':52} {ours[2]:9.1f}")
        print(
            f"   ours / baseline: {ours[0] / baseline[0]:.1f}x wall, {ours[1] / baseline[1]:.1f}x CPU "
            "(goal: 3x)"
        )


if __name__ == "__main__":
    main()
