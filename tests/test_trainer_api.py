"""The trainer's REST API: auth, validation, cancel, listing, series, deletion (the executor on the
bus is tests/test_trainer_service.py)."""

from __future__ import annotations

import httpx
import pytest

from services.trainer.runs import RunStore
from services.trainer.settings import TrainerSettings
from tests.conftest import TOKEN
from tests.test_trainer_service import _spec


async def test_auth_validation_and_cancel(api, tiny_world, tiny_checkpoint):
    async with httpx.AsyncClient(base_url=api) as anon:
        assert (await anon.get("/runs")).status_code == 401
        assert (await anon.get("/runs", headers={"Authorization": "Bearer nope"})).status_code == 401
        assert (await anon.get("/health")).status_code == 200  # health and metrics stay open
        assert (await anon.get("/openapi.json")).status_code == 200
    async with httpx.AsyncClient(base_url=api, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        bad = _spec(tiny_world, tiny_checkpoint)
        bad["algorithm"] = {"name": "pbsd", "delta": 0}
        r = await http.post("/runs", json=bad)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][:4] == [
            "body",
            "algorithm",
            "pbsd",
            "delta",
        ]
        bad = _spec(tiny_world, tiny_checkpoint)
        bad["data"]["train"] = "/nowhere.jsonl"
        r = await http.post("/runs", json=bad)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "data", "train"]
        assert (await http.get("/runs/nope")).status_code == 404
        assert (await http.get("/runs/nope/evals")).status_code == 404


def test_the_trainer_sets_what_it_started_with_aside_from_the_collector_while_it_serves(api):
    """A full collection walked the trainer's 395,000 objects for 136-172 ms (benchmarks/gc_pause.py)."""
    import gc

    assert gc.get_freeze_count() > 0


def test_the_api_needs_a_token_unless_local(tmp_path):
    with pytest.raises(ValueError, match="PBSD_TRAINER_API_TOKEN"):
        TrainerSettings(runs_dir=tmp_path)
    assert TrainerSettings(runs_dir=tmp_path, local_mode=True).api_token is None


async def test_cancel_a_queued_run(redis_url, key_prefix, tiny_world, tiny_checkpoint):
    import redis.asyncio as aioredis

    from proto.runs import RunSpec

    client = aioredis.Redis.from_url(redis_url)
    store = RunStore(client, key_prefix)
    record = await store.create(RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint)))
    assert await store.request_cancel(record.id) == "queued"
    assert (await store.get(record.id)).state == "cancelled"
    assert await store.next_queued() is None
    await client.aclose()


async def _parked_run(redis_url, key_prefix, spec, state: str, step: int = 0) -> str:
    """A run in ``state`` (at ``step``) that the api fixture's executor never starts: never on the
    queue (a run queued and taken off again could be taken by the executor in between)."""
    import time

    import redis.asyncio as aioredis

    from proto.base import new_id
    from proto.runs import RunSpec
    from services.trainer.runs import RunRecord, _to_hash

    client = aioredis.Redis.from_url(redis_url)
    store = RunStore(client, key_prefix)
    now = time.time()
    record = RunRecord(
        id=f"run-{time.strftime('%Y%m%d-%H%M%S')}-{new_id()[:6]}",
        name="parked",
        state=state,
        step=step,
        created_at=now,
        updated_at=now,
        spec=RunSpec.model_validate(spec),
    )
    await client.hset(f"{key_prefix}:run:{record.id}", mapping=_to_hash(record))
    await client.zadd(f"{key_prefix}:runs", {record.id: now})
    await store.add_metrics(record.id, {"step": 1.0})  # what a training step writes
    await store.add_metrics(record.id, {"step": 1.0}, series="evals")
    await store.mark_trained(record.id, ["t/0"])
    await client.aclose()
    return record.id


async def test_an_id_that_cannot_be_a_run_is_a_404_not_another_key(
    api, redis_url, key_prefix, tiny_world, tiny_checkpoint
):
    run_id = await _parked_run(redis_url, key_prefix, _spec(tiny_world, tiny_checkpoint), "completed")
    async with httpx.AsyncClient(base_url=api, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        assert (await http.get(f"/runs/{run_id}")).status_code == 200
        assert (await http.get(f"/runs/{run_id}/metrics")).json() == [{"step": 1.0}]
        # {prefix}:run:{id}:metrics and :trained are the run's list and set, not run hashes
        for bad in (f"{run_id}:metrics", f"{run_id}:evals", f"{run_id}:trained", f"{run_id}x", "nope"):
            for path in ("", "/metrics", "/evals", "/viewer"):
                r = await http.get(f"/runs/{bad}{path}")
                assert r.status_code == 404, (bad, path, r.status_code, r.text)
            r = await http.post(f"/runs/{bad}/cancel")
            assert r.status_code == 404, (bad, r.status_code, r.text)


async def test_list_limit_and_series_since_are_validated(
    api, redis_url, key_prefix, tiny_world, tiny_checkpoint
):
    spec = _spec(tiny_world, tiny_checkpoint)
    run_id = await _parked_run(redis_url, key_prefix, spec, "completed")
    await _parked_run(redis_url, key_prefix, spec, "completed")
    async with httpx.AsyncClient(base_url=api, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        for limit in (0, -1, 1001, "x"):
            r = await http.get("/runs", params={"limit": limit})
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "limit"], (
                limit,
                r.text,
            )
        assert len((await http.get("/runs", params={"limit": 1})).json()) == 1
        assert len((await http.get("/runs", params={"limit": 1000})).json()) == 2
        for series in ("metrics", "evals"):
            r = await http.get(f"/runs/{run_id}/{series}", params={"since": -1})
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "since"], r.text
            assert (await http.get(f"/runs/{run_id}/{series}", params={"since": 0})).json() == [{"step": 1.0}]
            assert (await http.get(f"/runs/{run_id}/{series}", params={"since": 1})).json() == []


async def test_cancelling_a_finished_run_is_a_conflict(
    api, redis_url, key_prefix, tiny_world, tiny_checkpoint
):
    spec = _spec(tiny_world, tiny_checkpoint)
    async with httpx.AsyncClient(base_url=api, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        for state in ("completed", "cancelled", "failed"):
            run_id = await _parked_run(redis_url, key_prefix, spec, state)
            r = await http.post(f"/runs/{run_id}/cancel")
            assert r.status_code == 409 and r.json()["detail"]["state"] == state, r.text
            assert state in r.json()["detail"]["msg"]
            assert (await http.get(f"/runs/{run_id}")).json()["state"] == state
        # a running run is asked to stop, as before
        run_id = await _parked_run(redis_url, key_prefix, spec, "running")
        r = await http.post(f"/runs/{run_id}/cancel")
        assert r.status_code == 202 and r.json()["state"] == "cancelling", r.text
        # a queued run never starts; cancelling it again is a conflict
        run_id = await _parked_run(redis_url, key_prefix, spec, "queued")
        r = await http.post(f"/runs/{run_id}/cancel")
        assert r.status_code == 202 and r.json()["state"] == "cancelled", r.text
        r = await http.post(f"/runs/{run_id}/cancel")
        assert r.status_code == 409 and r.json()["detail"]["state"] == "cancelled", r.text


async def test_a_tokenizer_directory_that_does_not_exist_is_a_422(api, tiny_world, tiny_checkpoint, tmp_path):
    async with httpx.AsyncClient(base_url=api, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        bad = _spec(tiny_world, tiny_checkpoint)
        bad["model"]["tokenizer"] = str(tmp_path / "nowhere")
        r = await http.post("/runs", json=bad)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "model", "tokenizer"], r.text
        assert "nowhere" in r.json()["detail"][0]["msg"]
        assert (await http.get("/runs")).json() == []  # nothing was queued
        # an existing one is accepted (and the run cancelled before it starts)
        good = _spec(tiny_world, tiny_checkpoint)
        good["model"]["tokenizer"] = str(tiny_checkpoint)
        r = await http.post("/runs", json=good)
        assert r.status_code == 201, r.text
        assert (await http.post(f"/runs/{r.json()['id']}/cancel")).status_code == 202


async def test_deleting_a_run_forgets_it_and_with_files_removes_its_folder(
    api, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    import redis.asyncio as aioredis

    spec = _spec(tiny_world, tiny_checkpoint)
    running = await _parked_run(redis_url, key_prefix, spec, "running")
    kept = await _parked_run(redis_url, key_prefix, spec, "completed")
    gone = await _parked_run(redis_url, key_prefix, spec, "completed")
    client = aioredis.Redis.from_url(redis_url)
    store = RunStore(client, key_prefix)
    for run_id in (kept, gone):  # the folder a run's executor writes
        (tmp_path / "runs" / run_id / "checkpoints").mkdir(parents=True)
        await store.update(run_id, output_dir=str(tmp_path / "runs" / run_id))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    async with httpx.AsyncClient(base_url=api, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        r = await http.delete(f"/runs/{running}")
        assert r.status_code == 409 and r.json()["detail"]["state"] == "running"
        assert (await http.delete(f"/runs/{kept}")).status_code == 204
        assert (await http.get(f"/runs/{kept}")).status_code == 404
        assert (tmp_path / "runs" / kept).is_dir()  # without ?files the folder stays
        assert (await http.delete(f"/runs/{gone}", params={"files": True})).status_code == 204
        assert not (tmp_path / "runs" / gone).exists()
        assert (await http.delete(f"/runs/{gone}")).status_code == 404
        assert [r["id"] for r in (await http.get("/runs")).json()] == [running]
        # a record pointing outside the trainer's runs folder never gets anything removed
        await store.update(running, state="failed", output_dir=str(outside))
        assert (await http.delete(f"/runs/{running}", params={"files": True})).status_code == 409
        assert outside.is_dir()
    for run_id in (kept, gone):
        for suffix in ("", ":metrics", ":evals", ":trained"):
            assert not await client.exists(f"{key_prefix}:run:{run_id}{suffix}")
    await client.aclose()


async def test_a_stored_spec_this_contract_refuses_is_a_conflict_not_a_server_error(
    api, redis_url, key_prefix, tiny_world, tiny_checkpoint
):
    """A run stored under an older, looser contract: its spec is shown as a 409 that says what to
    do, and everything that needs no spec (listing, series, deletion) still works."""
    import json

    import redis.asyncio as aioredis

    spec = _spec(tiny_world, tiny_checkpoint)
    run_id = await _parked_run(redis_url, key_prefix, spec, "completed")
    client = aioredis.Redis.from_url(redis_url)
    refused = dict(spec, algorithm={"name": "pbsd", "delta": 0})  # what today's contract refuses
    await client.hset(f"{key_prefix}:run:{run_id}", "spec", json.dumps(refused))
    await client.aclose()
    async with httpx.AsyncClient(base_url=api, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        for path in ("", "/viewer"):
            r = await http.get(f"/runs/{run_id}{path}")
            assert r.status_code == 409 and "can be deleted" in r.json()["detail"], (path, r.text)
        assert [r["id"] for r in (await http.get("/runs")).json()] == [run_id]
        assert (await http.get(f"/runs/{run_id}/metrics")).json() == [{"step": 1.0}]
        assert (await http.get(f"/runs/{run_id}/evals")).json() == [{"step": 1.0}]
        r = await http.post(f"/runs/{run_id}/cancel")
        assert r.status_code == 409 and r.json()["detail"]["state"] == "completed", r.text
        assert (await http.delete(f"/runs/{run_id}")).status_code == 204
        assert (await http.get(f"/runs/{run_id}")).status_code == 404
