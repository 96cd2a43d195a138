"""The multi-turn search agent: one trajectory, token in and token out.

    context = encode(system prompt + question + assistant opening)          loss mask 0
    repeat:
        generate one assistant message (stop at <|im_end|>)                  loss mask 1, a turn span
        a <use_mcp_tool> call -> the tool's answer -> encode(glue(answer))   loss mask 0
        \\boxed{} and no call -> final answer; stop
    stop also at the turn limit, when one message fills the per-turn budget,
    when the context is full, or on an error (recorded with its cause)

A trajectory a leaving worker handed back (:mod:`proto.handback`) goes on from the end of its
last whole exchange: ``progress`` holds where (``Progress.kept``), and notes where this one gets
to, for the worker to hand back in turn.

The trajectory's ids are exactly the engine's outputs and the glue appended after
them; nothing is re-tokenised. The reward is the verifier's on the last message.
"""

from __future__ import annotations

import logging
import secrets
import time
from array import array
from dataclasses import dataclass, field

import numpy as np

from agent.chat import ChatTokenizer
from agent.toolcall import Parsed, format_tool_failure, parse_tool_calls
from pbsd.verifier import extract_boxed, verify
from proto.handback import UnfinishedTrajectory
from proto.messages import ToolCall, Trajectory
from services.rollout import metrics
from services.rollout.engine import ContextFull, Engine, EngineError, GenerationRequest
from services.tools.client import Tools

log = logging.getLogger(__name__)

__all__ = ["AgentLimits", "Progress", "run_trajectory"]


def _narrow(routes: np.ndarray) -> np.ndarray:
    """Expert ids in the smallest type that holds them, as each turn comes in: SGLang sends int32, and
    a worker holds up to concurrency x G trajectories' routes at once (a 64K-token trajectory of a
    48-layer top-8 model: 96 MiB in int32, 24 MiB in bytes)."""
    small = routes.min(initial=0) >= 0 and routes.max(initial=0) < 256  # a -1 would become 255
    return routes.astype(np.uint8 if small else np.int16, copy=False)


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 300
    max_tokens_per_turn: int = 16_384
    max_context: int = 65_536
    temperature: float = 1.0
    top_p: float = 1.0
    return_routed_experts: bool = False
    max_calls_per_turn: int = 8  # of a message's tool calls, the ones past this fail unrun


@dataclass
class _Builder:
    """A trajectory as the loop grows it. Its per-token columns are arrays of machine numbers, not
    lists: a worker holds hundreds of thousands of tokens in flight, and the garbage collector walks
    every entry of a list in each full collection (a paper-scale group's lists held the event loop
    for 7-10 ms a collection, benchmarks/gc_pause.py), where an array is one object to it; an entry
    costs 4 bytes, not a pointer and a boxed number."""

    prompt: list[int]
    completion: array = field(default_factory=lambda: array("i"))  # int32
    mask: array = field(default_factory=lambda: array("B"))
    logprobs: array = field(default_factory=lambda: array("f"))  # float32, as the trajectory keeps them
    spans: list[tuple[int, int]] = field(default_factory=list)
    routes: list[np.ndarray] = field(default_factory=list)
    routed: int = 0  # positions whose routes are recorded

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.completion)

    def generated(self, ids: list[int], logprobs: list[float]) -> None:
        start = len(self.completion)
        self.completion.extend(ids)
        self.mask.frombytes(b"\x01" * len(ids))
        self.logprobs.extend(logprobs)
        self.spans.append((start, start + len(ids)))

    def glue(self, ids: list[int]) -> None:
        self.completion.extend(ids)
        self.mask.frombytes(bytes(len(ids)))
        self.logprobs.frombytes(bytes(self.logprobs.itemsize * len(ids)))  # 0.0

    @classmethod
    def resumed(cls, kept: UnfinishedTrajectory) -> _Builder:
        routes = [] if kept.routed_experts is None else [kept.routed_experts]
        return cls(
            prompt=kept.prompt_ids.tolist(),
            completion=array("i", kept.completion_ids.tobytes()),
            mask=array("B", kept.loss_mask.tobytes()),
            logprobs=array("f", kept.rollout_logprobs.tobytes()),
            spans=list(kept.turn_spans),
            routes=routes,
            routed=sum(r.shape[0] for r in routes),
        )


class Progress:
    """How far one trajectory has got, for a worker that leaves or dies before it ends: the
    trajectory once it has ended (``done``), else its turns up to the end of its last whole
    exchange (:meth:`kept_now`). The builder's lists only grow, so marking an exchange's end is
    noting their lengths, and the state at the mark is their first entries: a keep reads them in
    a thread while the trajectory goes on in the event loop, and what it reads is whole."""

    def __init__(self, kept: Trajectory | UnfinishedTrajectory | None = None) -> None:
        """``kept``: what a worker that left had done of this trajectory, which stands until this
        worker has gone on from it (a worker that leaves at once hands it on as it got it)."""
        self.done: Trajectory | None = kept if isinstance(kept, Trajectory) else None
        self._kept = kept if isinstance(kept, UnfinishedTrajectory) else None
        self._of: tuple | None = None  # the builder, calls, versions and ids being followed
        self._mark: tuple | None = None  # the lists' lengths at the last exchange's end, and its time

    @property
    def kept(self) -> UnfinishedTrajectory | None:
        """The handed-back unfinished trajectory to go on from, if any."""
        return self._kept

    def follow(self, b: _Builder, calls: list, versions: list, ids: tuple[str, int, str]) -> None:
        self._of, self._mark = (b, calls, versions, ids), None

    def mark(self, seconds: float) -> None:
        b, calls, versions, _ = self._of
        self._mark = (len(b.completion), len(b.spans), len(b.routes), len(calls), len(versions), seconds)

    @property
    def tokens(self) -> int:
        """Tokens a hand-back keeps (:meth:`kept_now`), prompt and completion: a cheap measure of
        how far it has got (every whole exchange adds some) and how large its keep is."""
        done = self.done
        if done is not None and done.finish_reason != "error":
            return done.num_tokens
        if self._mark is not None:
            return len(self._of[0].prompt) + self._mark[0]
        return self._kept.num_tokens if self._kept is not None else 0

    def kept_now(self) -> Trajectory | UnfinishedTrajectory | None:
        """What a keep holds of it now: the trajectory once it has ended, but for an error (the
        gateway gone as the worker left), whose whole exchanges are kept to go on from; else the
        trajectory as of its last mark (before one, what it was handed back as); None if it has
        no whole exchange yet."""
        done, mark = self.done, self._mark  # each read once: the loop may move them meanwhile
        if done is not None and done.finish_reason != "error":
            return done
        if mark is None:
            return self._kept
        b, calls, versions, (trajectory_id, sample_index, attempt) = self._of
        tokens, turns, routed, n_calls, n_versions, seconds = mark
        return UnfinishedTrajectory(
            trajectory_id=trajectory_id,
            sample_index=sample_index,
            prompt_ids=np.asarray(b.prompt, dtype=np.int32),
            completion_ids=np.asarray(b.completion[:tokens], dtype=np.int32),
            loss_mask=np.asarray(b.mask[:tokens], dtype=np.uint8),
            rollout_logprobs=np.asarray(b.logprobs[:tokens], dtype=np.float32),
            turn_spans=tuple(b.spans[:turns]),
            routed_experts=np.concatenate(b.routes[:routed], axis=0) if routed else None,
            tool_calls=tuple(calls[:n_calls]),
            versions=tuple(versions[:n_versions]),
            attempt=attempt,
            generation_s=seconds,
        )


async def _run_call(
    one: Parsed, k: int, turn: int, limits: AgentLimits, tools: Tools, attempt: str, place: int
) -> tuple[ToolCall, str | None]:
    """The ``k``-th call of a turn's message: its record, and the text that answers it (None: the
    gateway is unreachable, which fails the trajectory). ``attempt`` names this attempt's budget
    and ``place`` is the call's among those the trajectory has sent: a call made again by a
    trajectory that goes on from a keep (its exchange was not whole when its worker died) has
    the place it had, and counts once."""
    server, tool = (
        (one.call.server_name, one.call.tool_name) if one.call else one.names or ("unknown", "unknown")
    )
    args = one.call.arguments if one.call else {}
    named = {"turn": turn, "server_name": server, "tool_name": tool, "arguments": args}
    why = one.error
    if k >= limits.max_calls_per_turn:
        why = f"one message may make at most {limits.max_calls_per_turn} tool calls; this one was not run"
    if why is not None or one.call is None:
        return ToolCall(**named, ok=False, error=why, sent=False), format_tool_failure(
            server, tool, why or ""
        )
    reply = await tools.call(server, tool, args, trajectory_id=attempt, call_index=place)
    if reply.unreachable:
        return ToolCall(**named, ok=False, error=f"tool gateway unreachable: {reply.text}"), None
    error = None if reply.ok else reply.text
    return ToolCall(**named, ok=reply.ok, error=error, latency_s=reply.latency_s), reply.text


async def run_trajectory(
    engine: Engine,
    tools: Tools,
    tokenizer: ChatTokenizer,
    *,
    system: str,
    question: str,
    answer: str,
    aliases: tuple[str, ...] = (),
    trajectory_id: str,
    sample_index: int,
    limits: AgentLimits,
    seed: int | None = None,
    progress: Progress | None = None,
) -> Trajectory:
    resume = progress.kept if progress is not None else None
    if resume is None:
        b = _Builder(tokenizer.prompt_ids(system, question))
        calls: list[ToolCall] = []
        versions: list[int] = []
        # the gateway counts a trajectory's calls against its budget by this id. Trajectory ids
        # repeat: a prompt delivered again after a worker died, one published again, and every
        # `pbsd eval` of the same questions sample under the same ids, and each attempt gets a
        # whole budget; a handed-back trajectory goes on with the budget it had
        attempt = f"{trajectory_id}#{secrets.token_hex(6)}"
    else:
        b, calls, versions = _Builder.resumed(resume), list(resume.tool_calls), list(resume.versions)
        attempt = resume.attempt
    started = time.perf_counter() - (resume.generation_s if resume else 0.0)
    if progress is not None:
        progress.follow(b, calls, versions, (trajectory_id, sample_index, attempt))
    finish, error, last_text = "max_turns", None, ""
    engine_full = False  # it ended at its engine's context, shorter than max_context
    stop_ids = tuple(tokenizer.stop_ids)

    for turn in range(len(b.spans), limits.max_turns):
        budget = min(limits.max_tokens_per_turn, limits.max_context - b.length)
        if budget <= 0:
            finish = "max_context"
            break
        request = GenerationRequest(
            input_ids=b.prompt + b.completion.tolist(),
            max_new_tokens=budget,
            temperature=limits.temperature,
            top_p=limits.top_p,
            stop_token_ids=stop_ids,
            return_routed_experts=limits.return_routed_experts,
            routed_experts_start_len=b.routed,
            seed=None if seed is None else seed * 1000 + turn,
            session=trajectory_id,
        )
        try:
            result = await engine.generate(request)
        except ContextFull:
            # the engine's context (shorter than the run's max_context) is full: the trajectory ends
            # as at the run's own limit and is trained on as such, not left out as an error
            finish, engine_full = "max_context", True
            break
        except Exception as exc:  # EngineError, or what an engine let through (a torch error)
            if not isinstance(exc, EngineError):
                log.exception("engine raised on %s", trajectory_id)
                exc = f"{type(exc).__name__}: {exc}"
            finish, error = "error", f"engine failed: {exc}"  # this sample fails, not its group
            break
        if result.finish == "abort":
            finish, error = "error", f"engine aborted the request: {result.message or 'no reason given'}"
            break
        if not result.output_ids:
            finish, error = "error", "engine returned no tokens"
            break
        metrics.ENGINE_SECONDS.observe(result.latency_s)
        metrics.CACHED_TOKENS.inc(result.cached_tokens)
        versions.append(result.weight_version)
        b.generated(result.output_ids, result.logprobs)
        if result.routed_experts is not None:
            b.routes.append(_narrow(result.routed_experts))
            b.routed += result.routed_experts.shape[0]
        last_text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
        if result.finish == "length":
            engine_full = result.context_limited
            full = budget < limits.max_tokens_per_turn or engine_full
            finish = "max_context" if full else "max_tokens"
            break

        parsed = parse_tool_calls(last_text)
        if not parsed or tokenizer.ends_text(result.output_ids):
            # no tool call, or the model ended its text (no format's glue follows that): the agent
            # is done (a \boxed{} answer, or none at all)
            finish = "answer"
            break
        if turn == limits.max_turns - 1:
            break  # no turn left to read the tool's answer
        replies = []
        for k, one in enumerate(parsed):
            sent = sum(c.sent for c in calls)
            call, reply_text = await _run_call(one, k, turn, limits, tools, attempt, sent)
            calls.append(call)
            if reply_text is None:
                finish, error = "error", call.error
                break
            replies.append(reply_text)
        if error is not None:
            break
        # as MiroFlow joins the results of one message's calls; a lone surrogate a page's JSON spelled
        # cannot be tokenised or published, so it becomes U+FFFD
        reply_text = "\n".join(replies).encode("utf-8", "surrogatepass").decode("utf-8", "replace")
        glue = tokenizer.glue_ids(reply_text, closed=result.output_ids[-1] == tokenizer.end_id)
        if b.length + len(glue) >= limits.max_context:
            finish = "max_context"
            break
        b.glue(glue)
        if progress is not None:  # an exchange ends here: a worker that leaves keeps it
            progress.mark(time.perf_counter() - started)

    routes, end = None, len(b.completion)
    if limits.return_routed_experts and b.routes and error is None:
        routes = np.concatenate(b.routes, axis=0)
        # trailing glue whose routes were never computed is dropped; the builder itself is left as
        # it is, since a keep of the group may be reading it in another thread (Progress)
        end = min(end, routes.shape[0] + 1 - len(b.prompt))
    if engine_full:
        metrics.CONTEXT_FULL.inc()  # it ended at the engine's context, not at the run's
    final = extract_boxed(last_text) if finish == "answer" else None
    reward = verify(last_text, answer, aliases).reward if finish == "answer" else 0.0
    return Trajectory(
        trajectory_id=trajectory_id,
        sample_index=sample_index,
        policy_version=min(versions, default=engine.weight_version),
        prompt_ids=np.asarray(b.prompt, dtype=np.int32),
        completion_ids=np.asarray(b.completion[:end], dtype=np.int32),
        loss_mask=np.asarray(b.mask[:end], dtype=np.uint8),
        rollout_logprobs=np.asarray(b.logprobs[:end], dtype=np.float32),
        turn_spans=tuple(b.spans),
        routed_experts=routes,
        tool_calls=tuple(calls),
        final_answer=final,
        reward=reward,
        finish_reason=finish,
        error=error,
        generation_s=time.perf_counter() - started,
    )
