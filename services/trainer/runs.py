"""Runs and their state, kept in Redis so that they survive a trainer restart.

{prefix}:runs                 sorted set of run ids by submission time
{prefix}:runs:queue           list of run ids waiting to start (FIFO)
{prefix}:run:{id}             hash: spec, state, step, policy_version, timestamps, error, latest metrics, ...
{prefix}:run:{id}:metrics     list of per-step metric records (JSON)
{prefix}:run:{id}:evals       list of validation rounds (JSON; runs with data.validation)
{prefix}:run:{id}:trained     set of trajectory ids already trained on (duplicates are dropped)
{prefix}:run:{id}:dropped     set of prompt indices whose groups were dropped and replaced (stale), and
                              no other group of which was trained (a later copy that is unmarks it)
{prefix}:run:{id}:timelines   hash: every weights timeline the run opened -> the version it opened at
{prefix}:run:{id}:copies      hash: message id -> prompt index, of every prompt copy published ahead of the
                              queue (after a crash, or for a group sampled with discarded weights) and its group

The run's hash also counts the prompts published (``published``): with the trained and dropped
sets, a resume after a crash tells the prompts still in flight from those the lost steps consumed.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Literal

import redis.asyncio as aioredis
from pydantic import BaseModel, ValidationError

from proto.base import new_id
from proto.runs import RunSpec

__all__ = ["ACTIVE", "FINISHED", "RunRecord", "RunStore", "RunSummary"]

log = logging.getLogger(__name__)

State = Literal["queued", "running", "cancelling", "completed", "cancelled", "failed"]
ACTIVE = ("queued", "running", "cancelling")
FINISHED = ("completed", "cancelled", "failed")


class RunSummary(BaseModel):
    """A run as a listing shows it: everything but its spec, which can be a large document."""

    id: str
    name: str
    state: State
    step: int = 0
    policy_version: int = 0
    created_at: float
    updated_at: float
    error: str | None = None
    latest_metrics: dict[str, float] = {}
    latest_eval: dict[str, Any] = {}  # the last validation round (runs with data.validation)
    output_dir: str | None = None


class RunRecord(RunSummary):
    spec: RunSpec


class RunStore:
    def __init__(self, client: aioredis.Redis, prefix: str = "pbsd") -> None:
        self.redis = client
        self.prefix = prefix

    def _key(self, run_id: str, suffix: str = "") -> str:
        return f"{self.prefix}:run:{run_id}{suffix}"

    async def create(self, spec: RunSpec) -> RunRecord:
        run_id = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{new_id()[:6]}"
        now = time.time()
        record = RunRecord(
            id=run_id, name=spec.name, state="queued", created_at=now, updated_at=now, spec=spec
        )
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._key(run_id), mapping=_to_hash(record))
            pipe.zadd(f"{self.prefix}:runs", {run_id: now})
            pipe.rpush(f"{self.prefix}:runs:queue", run_id)
            await pipe.execute()
        return record

    async def get(self, run_id: str) -> RunRecord | None:
        data = await self.redis.hgetall(self._key(run_id))
        return _from_hash(data) if data else None

    async def summary(self, run_id: str) -> RunSummary | None:
        """A run's record without its spec: what reads even where a stricter contract refuses the spec."""
        values = await self.redis.hmget(self._key(run_id), _SUMMARY)
        return None if values[0] is None else _summary_of(values)

    async def list(self, limit: int = 100) -> list[RunSummary]:
        """The newest ``limit`` runs, without their specs: a listing of a thousand runs must not
        read, parse and send a thousand specs. A record that no longer reads is logged and left
        out: it must not make every listing fail."""
        ids = [_s(i) for i in await self.redis.zrevrange(f"{self.prefix}:runs", 0, limit - 1)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for run_id in ids:
                pipe.hmget(self._key(run_id), _SUMMARY)
            rows = await pipe.execute()
        summaries = []
        for run_id, values in zip(ids, rows, strict=True):
            if values[0] is None:  # deleted between the two reads
                continue
            try:
                summaries.append(_summary_of(values))
            except (ValidationError, ValueError, TypeError) as exc:  # a field missing or malformed
                log.error("run %s: its stored record does not read (%s); left out", run_id, exc)
        return summaries

    async def update(self, run_id: str, **fields: Any) -> None:
        await self.redis.hset(self._key(run_id), mapping=_mapping(fields))

    async def next_queued(self) -> str | None:
        run_id = await self.redis.lpop(f"{self.prefix}:runs:queue")
        return run_id.decode() if isinstance(run_id, bytes) else run_id

    async def requeue_orphans(self) -> list[str]:
        """Queue again, in submission order, the runs still "queued" that are in no queue: a
        trainer that took one off the queue and died before it was "running" (while loading
        its model, say) lost it. Only the trainer takes runs off the queue, and it calls this
        before it takes any."""
        queue = {_s(x) for x in await self.redis.lrange(f"{self.prefix}:runs:queue", 0, -1)}
        orphans = [r for r in await self.in_state("queued") if r not in queue]
        if orphans:
            await self.redis.lpush(f"{self.prefix}:runs:queue", *reversed(orphans))  # ahead of newer ones
        return orphans

    async def in_state(self, *states: str) -> list[str]:
        """The ids of every run in one of ``states``, in submission order (however many runs there are)."""
        runs = [_s(x) for x in await self.redis.zrange(f"{self.prefix}:runs", 0, -1)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for run_id in runs:
                pipe.hget(self._key(run_id), "state")
            found = await pipe.execute()
        return [r for r, state in zip(runs, found, strict=True) if _s(state) in states]

    # one step, so that a cancel that lands while the trainer loads the run's model (the run is
    # off the queue but still "queued") is not overwritten by "running"
    _START = """
    local state = redis.call('HGET', KEYS[1], 'state')
    if state == 'queued' or state == 'running' or state == 'cancelling' then
        redis.call('HSET', KEYS[1], unpack(ARGV))
        if state ~= 'cancelling' then
            redis.call('HSET', KEYS[1], 'state', 'running')
        end
    end
    return state
    """

    async def start(self, run_id: str, **fields: Any) -> str | None:
        """Mark a run "running" (a "cancelling" one stays so) with ``fields``, unless it was
        cancelled or has finished meanwhile: then nothing is written. Returns the state it found."""
        args = [x for pair in _mapping(fields).items() for x in pair]
        return _s(await self.redis.eval(self._START, 1, self._key(run_id), *args))

    # one step, so that a run finishing meanwhile is never turned back to "cancelling"
    _CANCEL = """
    local state = redis.call('HGET', KEYS[1], 'state')
    if state == 'queued' then
        redis.call('LREM', KEYS[2], 0, ARGV[1])
        redis.call('HSET', KEYS[1], 'state', 'cancelled', 'updated_at', ARGV[2])
    elseif state == 'running' then
        redis.call('HSET', KEYS[1], 'state', 'cancelling', 'updated_at', ARGV[2])
    end
    return state
    """

    async def request_cancel(self, run_id: str) -> str | None:
        """Cancel a queued run at once, ask a running one to stop; a finished run is left as it is.
        Returns the state the run was in (None: no such run)."""
        keys = [self._key(run_id), f"{self.prefix}:runs:queue"]
        return _s(await self.redis.eval(self._CANCEL, len(keys), *keys, run_id, repr(time.time())))

    async def add_metrics(self, run_id: str, record: dict[str, Any], *, series: str = "metrics") -> None:
        """Append to one of the run's series: ``metrics`` (one record a step) or ``evals`` (a round)."""
        await self.redis.rpush(self._key(run_id, f":{series}"), json.dumps(record))

    async def add_eval(self, run_id: str, record: dict[str, Any]) -> None:
        """Append a validation round to the ``evals`` series and make it the run's latest, at once:
        a round stored again after one of the two failed would be listed twice."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.rpush(self._key(run_id, ":evals"), json.dumps(record))
            pipe.hset(self._key(run_id), mapping=_mapping({"latest_eval": record}))
            await pipe.execute()

    async def delete(self, run_id: str) -> None:
        """Forget a run: its record, metrics, validation rounds and trained set (files stay)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(*(self._key(run_id, s) for s in _SERIES))
            pipe.zrem(f"{self.prefix}:runs", run_id)
            pipe.lrem(f"{self.prefix}:runs:queue", 0, run_id)
            await pipe.execute()

    async def truncate_metrics(self, run_id: str, steps: int) -> None:
        """Keep the first ``steps`` step records: a run resumed from the checkpoint of step
        ``steps`` trains the steps after it again, and records them again."""
        key = self._key(run_id, ":metrics")
        if steps > 0:
            await self.redis.ltrim(key, 0, steps - 1)
        else:
            await self.redis.delete(key)

    async def truncate_evals(self, run_id: str, step: int) -> None:
        """Keep the validation rounds of steps up to ``step``: those after it scored weights a
        crash discarded, and the resumed run evaluates the steps again."""
        key = self._key(run_id, ":evals")
        keep = [x for x in await self.redis.lrange(key, 0, -1) if json.loads(x)["step"] <= step]
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            if keep:
                pipe.rpush(key, *keep)
            await pipe.execute()

    async def metrics(self, run_id: str, since: int = 0, *, series: str = "metrics") -> list[dict[str, Any]]:
        return [json.loads(x) for x in await self.redis.lrange(self._key(run_id, f":{series}"), since, -1)]

    async def mark_trained(self, run_id: str, trajectory_ids: list[str]) -> None:
        if trajectory_ids:
            await self.redis.sadd(self._key(run_id, ":trained"), *trajectory_ids)

    async def trained(self, run_id: str, trajectory_ids: list[str]) -> list[bool]:
        if not trajectory_ids:
            return []
        return [bool(x) for x in await self.redis.smismember(self._key(run_id, ":trained"), trajectory_ids)]

    async def reset_consumed(self, run_id: str, trajectory_ids: list[str], dropped: list[int]) -> None:
        """After a resume from a checkpoint: the trained and dropped sets are the checkpoint's."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._key(run_id, ":trained"), self._key(run_id, ":dropped"))
            if trajectory_ids:
                pipe.sadd(self._key(run_id, ":trained"), *trajectory_ids)
            if dropped:
                pipe.sadd(self._key(run_id, ":dropped"), *dropped)
            await pipe.execute()

    async def mark_dropped(self, run_id: str, index: int) -> None:
        """Prompt ``index``'s group was dropped and the prompt replaced by another."""
        await self.redis.sadd(self._key(run_id, ":dropped"), index)

    async def unmark_dropped(self, run_id: str, index: int) -> None:
        """Another group of prompt ``index`` is trained: it is not dropped after all."""
        await self.redis.srem(self._key(run_id, ":dropped"), index)

    async def dropped(self, run_id: str) -> set[int]:
        return {int(x) for x in await self.redis.smembers(self._key(run_id, ":dropped"))}

    async def set_published(self, run_id: str, count: int) -> None:
        """The run has published its first ``count`` prompts (written after they are on the bus)."""
        await self.redis.hset(self._key(run_id), "published", str(count))

    async def published(self, run_id: str) -> int | None:
        """How many prompts the run has published; None when it never said (or its record is gone)."""
        value = await self.redis.hget(self._key(run_id), "published")
        return int(value) if value else None

    async def set_letters_after(self, run_id: str, entry_id: str) -> None:
        """The dead-letter stream's last entry as the run first opened: none after it is older."""
        await self.redis.hset(self._key(run_id), "letters_after", entry_id)

    async def letters_after(self, run_id: str) -> str:
        """Where the run's dead letters begin; the stream's start for a run that never said."""
        value = await self.redis.hget(self._key(run_id), "letters_after")
        return _s(value) or "0-0"

    async def add_timeline(self, run_id: str, timeline: str, version: int) -> None:
        await self.redis.hset(self._key(run_id, ":timelines"), timeline, str(version))

    async def timelines(self, run_id: str) -> dict[str, int]:
        """Every weights timeline the run opened, with the version it opened at."""
        found = await self.redis.hgetall(self._key(run_id, ":timelines"))
        return {_s(k): int(v) for k, v in found.items()}

    async def add_copies(self, run_id: str, copies: dict[str, int]) -> None:
        """Prompt copies published ahead of the queue (their and their groups' message ids, each
        with its prompt's index): written before they go out, kept for the run's life."""
        if copies:
            await self.redis.hset(
                self._key(run_id, ":copies"), mapping={k: str(v) for k, v in copies.items()}
            )

    async def copies(self, run_id: str) -> dict[str, int]:
        found = await self.redis.hgetall(self._key(run_id, ":copies"))
        return {_s(k): int(v) for k, v in found.items()}

    async def trained_ids(self, run_id: str) -> list[str]:
        return sorted(
            x.decode() if isinstance(x, bytes) else x
            for x in await self.redis.smembers(self._key(run_id, ":trained"))
        )


_SERIES = ("", ":metrics", ":evals", ":trained", ":dropped", ":timelines", ":copies")


def _s(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _mapping(fields: dict[str, Any]) -> dict[str, str]:
    """Fields of a run's hash as Redis stores them, with ``updated_at`` now."""
    fields = {**fields, "updated_at": time.time()}
    return {
        k: json.dumps(v) if isinstance(v, dict) else ("" if v is None else str(v)) for k, v in fields.items()
    }


def _to_hash(record: RunRecord) -> dict[str, str]:
    return {
        "id": record.id,
        "name": record.name,
        "state": record.state,
        "step": str(record.step),
        "policy_version": str(record.policy_version),
        "created_at": repr(record.created_at),
        "updated_at": repr(record.updated_at),
        "error": record.error or "",
        "latest_metrics": json.dumps(record.latest_metrics),
        "latest_eval": json.dumps(record.latest_eval),
        "output_dir": record.output_dir or "",
        "spec": record.spec.model_dump_json(),
    }


_SUMMARY = tuple(RunSummary.model_fields)  # the hash's fields a listing reads


def _summary_of(values: list) -> RunSummary:
    """A summary from the hash's ``_SUMMARY`` fields, in that order (HMGET's answer)."""
    return RunSummary(**_summary_fields(dict(zip(_SUMMARY, values, strict=True))))


def _summary_fields(data: dict) -> dict[str, Any]:
    """A run hash's fields, but its spec, as :class:`RunSummary` takes them."""
    d = {_s(k): _s(v) for k, v in data.items()}
    return {
        "id": d["id"],
        "name": d["name"],
        "state": d["state"],
        "step": int(d.get("step") or 0),
        "policy_version": int(d.get("policy_version") or 0),
        "created_at": float(d["created_at"]),
        "updated_at": float(d["updated_at"]),
        "error": d.get("error") or None,
        "latest_metrics": json.loads(d.get("latest_metrics") or "{}"),
        "latest_eval": json.loads(d.get("latest_eval") or "{}"),
        "output_dir": d.get("output_dir") or None,
    }


def _from_hash(data: dict) -> RunRecord:
    spec = data.get(b"spec", data.get("spec"))
    return RunRecord(**_summary_fields(data), spec=RunSpec.model_validate_json(spec))
