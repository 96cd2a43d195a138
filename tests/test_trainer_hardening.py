"""The attacks of the fault-injection and security battery (issue 25, items 7, 8, 9 and 11) against
the trainer's API, and the body cap of the rollout and scorer apps, kept as tests. Every target
is a real service on loopback that the test starts itself."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import TOKEN
from tests.test_trainer_service import _spec

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _raw(base: str, head: str, body: bytes = b"", *, timeout: float = 10.0) -> str:
    """Send a request's head and the start of its body on a socket, then read what comes back
    without sending the rest: a server that reads the whole body first never answers in time."""
    url = urlsplit(base)
    with socket.create_connection((url.hostname, url.port), timeout=timeout) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        answer, started = b"", time.monotonic()
        while b"\r\n\r\n" not in answer and time.monotonic() - started < timeout:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            answer += chunk
    return answer.decode(errors="replace")


def _post_head(path: str, length: int | None, *, token: bool, chunked: bool = False) -> str:
    lines = [f"POST {path} HTTP/1.1", "Host: trainer", "Content-Type: application/json"]
    if token:
        lines.append(f"Authorization: Bearer {TOKEN}")
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}")
    return "\n".join(lines) + "\n"


# -- item 8: authenticate first, cap the body --------------------------------------------------
def test_an_anonymous_200_mb_submission_is_refused_before_its_body_is_read(api):
    """It held 600 MB for 3.7 s before its 401: now the 401 comes while the body is still unsent."""
    started = time.monotonic()
    answer = _raw(api, _post_head("/runs", 200 * 2**20, token=False), b'{"name": "' + b"x" * 4096)
    assert answer.startswith("HTTP/1.1 401"), answer[:200]
    assert time.monotonic() - started < 5


def test_an_anonymous_invalid_body_is_a_401_not_a_description_of_the_spec(api):
    for body in ('{"model": {"path": 1}}', "{not json", '{"trainer": {"lr": NaN}}', ""):
        r = httpx.post(f"{api}/runs", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 401 and r.json() == {"detail": "missing or wrong bearer token"}, r.text
        r = httpx.post(f"{api}/runs", content=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401, r.text
    for path in ("/runs/run-20260101-000000-abcdef", "/runs/run-20260101-000000-abcdef/cancel"):
        assert httpx.post(f"{api}{path}", content=b"x" * 100).status_code == 401


def test_an_authenticated_body_over_the_cap_is_refused_unread(api):
    answer = _raw(api, _post_head("/runs", 200 * 2**20, token=True), b"{")
    assert answer.startswith("HTTP/1.1 413"), answer[:200]

    def chunks():  # no Content-Length: cut off once past the cap (1 MiB)
        for _ in range(64):
            yield b" " * 65536

    r = httpx.post(f"{api}/runs", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and "over 1048576 bytes" in r.json()["detail"], r.text


# -- item 7: NaN bodies and huge indices -----------------------------------------------------
@pytest.mark.parametrize(
    ("field", "token", "loc"),
    [
        ("lr", "NaN", ["body", "trainer", "lr"]),
        ("lr", "Infinity", ["body", "trainer", "lr"]),
        ("lr", "-Infinity", ["body", "trainer", "lr"]),
        ("top_p", "NaN", ["body", "rollout", "top_p"]),
    ],
)
def test_nan_in_a_run_spec_is_a_422_that_does_not_echo_it(
    api, tiny_world, tiny_checkpoint, field, token, loc
):
    spec = _spec(tiny_world, tiny_checkpoint)
    section = "trainer" if field == "lr" else "rollout"
    spec[section][field] = "__TOKEN__"
    body = json.dumps(spec).replace('"__TOKEN__"', token)
    r = httpx.post(f"{api}/runs", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]  # valid JSON: nothing non-finite came back
    assert detail[0]["loc"] == loc and set(detail[0]) == {"loc", "msg", "type"}
    assert httpx.get(f"{api}/runs", headers=AUTH).json() == []  # nothing was queued


def test_nan_inside_an_inline_deepspeed_config_is_refused(api, tiny_world, tiny_checkpoint):
    spec = _spec(tiny_world, tiny_checkpoint)
    spec["trainer"]["deepspeed_config"] = {
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "__TOKEN__"}
    }
    body = json.dumps(spec).replace('"__TOKEN__"', "NaN")
    r = httpx.post(f"{api}/runs", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "trainer", "deepspeed_config"]


@pytest.mark.parametrize(("lists", "code"), [(32, 201), (33, 422), (250, 422), (900, 422)])
def test_a_deepspeed_config_nests_no_deeper_than_the_store_reads_back(
    api, tiny_world, tiny_checkpoint, lists, code
):
    """About 200 levels were accepted and then made every listing a 500 (the store reads specs back
    with a parser that refuses them) and the executor's queue unreadable; about 330 were a 500 at
    once (the finiteness check ran out of stack)."""
    spec = _spec(tiny_world, tiny_checkpoint)
    spec["trainer"]["deepspeed_config"] = "__CONFIG__"
    config = '{"a": ' + "[" * lists + "]" * lists + "}"
    body = json.dumps(spec).replace('"__CONFIG__"', config)
    r = httpx.post(f"{api}/runs", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == code, r.text
    if code == 422:
        assert r.json()["detail"][0]["loc"] == ["body", "trainer", "deepspeed_config"]
        assert "at most 32 levels" in r.json()["detail"][0]["msg"]
        return
    run = r.json()["id"]
    assert httpx.get(f"{api}/runs/{run}", headers=AUTH).status_code == 200
    assert [x["id"] for x in httpx.get(f"{api}/runs", headers=AUTH).json()] == [run]


def test_paths_no_file_system_takes_are_a_422(api, tiny_world, tiny_checkpoint):
    """A NUL byte and a name longer than the file system's were 500s (ValueError and OSError where the
    trainer looked the path up); an over-long path is refused before it is echoed back."""
    long_name = "b" * 300
    cases = [
        ("data", "train", "q\x00.jsonl"),
        ("model", "path", f"{tiny_checkpoint}\x00"),
        ("data", "train", f"{tiny_world}/{long_name}.jsonl"),
        ("model", "path", f"{tiny_world}/{long_name}"),
        ("data", "validation", "/" + "d/" * 3000),
    ]
    for section, key, value in cases:
        spec = _spec(tiny_world, tiny_checkpoint)
        spec[section][key] = value
        r = httpx.post(f"{api}/runs", json=spec, headers=AUTH)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][:3] == ["body", section, key], r.text
        assert len(r.text) < 1000
    assert httpx.get(f"{api}/runs", headers=AUTH).json() == []


@pytest.mark.parametrize(("section", "key"), [("trainer", "seed"), ("data", "shuffle_seed")])
def test_a_seed_no_random_generator_takes_is_refused_at_submission(tiny_world, tiny_checkpoint, section, key):
    """-1 and 10**30 were accepted, and the run failed at its start (numpy, torch.manual_seed)."""
    from pydantic import ValidationError

    from proto.runs import RunSpec

    for seed in (-1, 2**53, 10**30):
        spec = _spec(tiny_world, tiny_checkpoint)
        spec[section][key] = seed
        with pytest.raises(ValidationError) as refused:
            RunSpec.model_validate(spec)
        assert refused.value.errors()[0]["loc"] == (section, key)
    spec[section][key] = 2**53 - 1
    assert getattr(getattr(RunSpec.model_validate(spec), section), key) == 2**53 - 1


async def test_a_stored_record_that_no_longer_reads_leaves_the_others_listed(
    api, redis_url, key_prefix, tiny_world, tiny_checkpoint
):
    """A contract made stricter (a bound, a pattern) must not turn the records stored under the
    looser one into a 500 on every listing and an executor that cannot read its queue; such a
    run is still listed, a 409 to show, and can be cancelled and deleted."""
    import redis.asyncio as aioredis

    from tests.test_trainer_api import _parked_run

    kept = await _parked_run(redis_url, key_prefix, _spec(tiny_world, tiny_checkpoint), "completed")
    old = await _parked_run(redis_url, key_prefix, _spec(tiny_world, tiny_checkpoint), "failed")
    client = aioredis.Redis.from_url(redis_url)
    stored = json.loads(await client.hget(f"{key_prefix}:run:{old}", "spec"))
    stored["trainer"]["seed"] = -1  # what the contract took before seeds were bounded
    await client.hset(f"{key_prefix}:run:{old}", "spec", json.dumps(stored))
    active = await _parked_run(redis_url, key_prefix, _spec(tiny_world, tiny_checkpoint), "running")
    await client.hset(f"{key_prefix}:run:{active}", "spec", json.dumps(stored))
    await client.aclose()
    async with httpx.AsyncClient(base_url=api, headers=AUTH) as http:
        r = await http.post(f"/runs/{active}/cancel")  # once a 500, after the cancel had been written
        assert r.status_code == 202 and r.json()["state"] == "cancelling" and "spec" not in r.json(), r.text
        r = await http.get("/runs")  # a listing shows no spec, so all three are there
        assert r.status_code == 200 and [x["id"] for x in r.json()] == [active, old, kept]
        assert all("spec" not in x for x in r.json())
        assert (await http.get(f"/runs/{kept}")).status_code == 200
        r = await http.get(f"/runs/{old}")
        assert r.status_code == 409 and "does not read" in r.json()["detail"], r.text
        assert (await http.get(f"/runs/{old}/metrics")).json() == [{"step": 1.0}]
        assert (await http.delete(f"/runs/{old}")).status_code == 204  # and it can be cleared away
        assert [x["id"] for x in (await http.get("/runs")).json()] == [active, kept]
    client = aioredis.Redis.from_url(redis_url)  # a record without its times (float(None) once raised)
    await client.hset(f"{key_prefix}:run:run-20260101-000000-abcdef", mapping={"id": "x", "state": "failed"})
    await client.zadd(f"{key_prefix}:runs", {"run-20260101-000000-abcdef": 0})
    await client.aclose()
    async with httpx.AsyncClient(base_url=api, headers=AUTH) as http:
        assert [x["id"] for x in (await http.get("/runs")).json()] == [active, kept]


def test_a_blank_optional_path_reads_as_none(tiny_world, tiny_checkpoint):
    """The trainer took "" for no validation set or no separate tokenizer, and stored it so."""
    from proto.runs import RunSpec

    spec = _spec(tiny_world, tiny_checkpoint)
    spec["data"]["validation"], spec["model"]["tokenizer"] = "", ""
    read = RunSpec.model_validate(spec)
    assert read.data.validation is None and read.model.tokenizer is None


@pytest.mark.parametrize(
    ("section", "key", "most"),
    [
        ("rollout", "group_size", 1024),
        ("rollout", "max_staleness", 64),
        ("rollout", "max_context", 2**24),
        ("trainer", "prompts_per_step", 65_536),
    ],
)
def test_a_spec_cannot_ask_for_unbounded_work_at_once(tiny_world, tiny_checkpoint, section, key, most):
    """group_size 10**9 was accepted: a rollout worker would gather 10**9 samples of one prompt; a
    staleness or batch as large had the controller publish 10**9 prompts at once."""
    from pydantic import ValidationError

    from proto.runs import RunSpec

    spec = _spec(tiny_world, tiny_checkpoint)
    spec[section][key] = most
    assert getattr(getattr(RunSpec.model_validate(spec), section), key) == most
    for value in (most + 1, 10**9):
        spec[section][key] = value
        with pytest.raises(ValidationError) as refused:
            RunSpec.model_validate(spec)
        assert refused.value.errors()[0]["loc"] == (section, key)


async def test_a_series_index_past_what_redis_takes_is_a_422(
    api, redis_url, key_prefix, tiny_world, tiny_checkpoint
):
    from tests.test_trainer_api import _parked_run

    run_id = await _parked_run(redis_url, key_prefix, _spec(tiny_world, tiny_checkpoint), "completed")
    async with httpx.AsyncClient(base_url=api, headers=AUTH) as http:
        for series in ("metrics", "evals"):
            for since in (2**63, 2**63 - 1, 2**31):
                r = await http.get(f"/runs/{run_id}/{series}", params={"since": since})
                assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "since"], r.text
            assert (await http.get(f"/runs/{run_id}/{series}", params={"since": 2**31 - 1})).json() == []
        for limit in (0, 2001, 10**9):  # 100,000 trajectories, decoded at once, were accepted
            assert (await http.get(f"/runs/{run_id}/viewer", params={"limit": limit})).status_code == 422


# -- item 9: paths only under the trainer's roots ---------------------------------------------
async def test_spec_paths_outside_the_roots_are_refused_alike_whether_or_not_they_exist(
    api, tiny_world, tiny_checkpoint, tmp_path_factory
):
    root = tmp_path_factory.getbasetemp()
    escape = "../" * len(root.parts)
    (root / "hardening-link").unlink(missing_ok=True)
    (root / "hardening-link").symlink_to("/etc")
    async with httpx.AsyncClient(base_url=api, headers=AUTH) as http:

        async def refusal(section: str, key: str, value) -> tuple[int, list, str]:
            spec = _spec(tiny_world, tiny_checkpoint)
            spec[section][key] = value
            r = await http.post("/runs", json=spec)
            detail = r.json()["detail"][0]
            return r.status_code, tuple(detail["loc"]), detail["msg"].replace(str(value), "<path>")

        outside = [
            "/etc/passwd",  # there
            "/etc/no-such-file-here",  # not there
            f"{root}/{escape}etc/passwd",  # out through ..
            f"{root}/hardening-link/passwd",  # out through a link inside a root
            "../../../../etc",
        ]
        answers = {await refusal("data", "train", p) for p in outside}
        assert answers == {
            (
                422,
                ("body", "data", "train"),
                "<path> is not under the trainer's data roots (PBSD_TRAINER_DATA_ROOTS)",
            )
        }
        models = {
            await refusal("model", "path", p) for p in ("/etc", "/etc/nothing", f"{root}/hardening-link")
        }
        assert len(models) == 1 and "model roots" in next(iter(models))[2]
        status_code, loc, msg = await refusal(
            "data", "validation", str(root / "no-such.jsonl")
        )  # inside: named
        assert (status_code, loc, msg) == (
            422,
            ("body", "data", "validation"),
            "no file at <path> on the trainer",
        )
        code, loc, _ = await refusal("trainer", "deepspeed_config", "/etc/hostname")
        assert (code, loc) == (422, ("body", "trainer", "deepspeed_config"))
        assert (await http.get("/runs")).json() == []  # nothing was queued
        # accepted paths are stored resolved: the run reads what was checked
        spec = _spec(tiny_world, tiny_checkpoint)
        spec["data"]["train"] = str(tiny_world / "questions" / ".." / "questions" / "rl.jsonl")
        r = await http.post("/runs", json=spec)
        assert r.status_code == 201, r.text
        shown = (await http.get(f"/runs/{r.json()['id']}")).json()["spec"]
        assert shown["data"]["train"] == str((tiny_world / "questions" / "rl.jsonl").resolve())
        assert (await http.post(f"/runs/{r.json()['id']}/cancel")).status_code == 202


def test_the_roots_default_to_the_working_directory_and_hub_ids_pass_only_when_allowed(tmp_path, monkeypatch):
    from proto.runs import RunSpec
    from services.trainer.settings import TrainerSettings
    from services.trainer.spec_paths import SpecPathError, resolve_spec_paths

    (tmp_path / "q.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    spec = RunSpec.model_validate(
        {"model": {"path": "Qwen/Qwen3-0.6B"}, "data": {"train": "q.jsonl"}, "algorithm": {"name": "grpo"}}
    )
    settings = TrainerSettings(local_mode=True, runs_dir=tmp_path / "runs")
    with pytest.raises(SpecPathError, match=r"no directory at Qwen/Qwen3-0\.6B"):
        resolve_spec_paths(spec, settings)
    hub = TrainerSettings(local_mode=True, runs_dir=tmp_path / "runs", hub_models=True)
    resolved = resolve_spec_paths(spec, hub)
    assert resolved.model.path == "Qwen/Qwen3-0.6B" and resolved.data.train == str(tmp_path / "q.jsonl")
    for path in ("../Qwen3", "./x", "/abs/path"):  # path forms are never taken for hub ids
        with pytest.raises(SpecPathError):
            resolve_spec_paths(
                spec.model_copy(update={"model": spec.model.model_copy(update={"path": path})}), hub
            )


# -- item 11: a run that failed before it started leaves no folder behind ----------------------
async def test_deleting_a_run_that_failed_before_it_started_removes_its_weights_folder(
    api, tmp_path, tiny_world, tiny_checkpoint
):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    spec = _spec(tiny_world, tiny_checkpoint)
    spec["data"]["train"] = str(empty)
    async with httpx.AsyncClient(base_url=api, headers=AUTH) as http:
        run_id = (await http.post("/runs", json=spec)).raise_for_status().json()["id"]
        async with asyncio.timeout(60):
            while (record := (await http.get(f"/runs/{run_id}")).json())["state"] != "failed":
                await asyncio.sleep(0.1)
        assert record["output_dir"] is None and (tmp_path / "runs" / run_id / "weights").is_dir()
        assert (await http.delete(f"/runs/{run_id}", params={"files": True})).status_code == 204
    assert not (tmp_path / "runs" / run_id).exists()


# -- item 8 for the workers: their apps take no body, and hold none ----------------------------
def test_the_scorer_app_refuses_a_large_body_unread(tiny_checkpoint, redis_url, key_prefix, monkeypatch):
    from services.scorer.app import create_app
    from services.scorer.settings import ScorerSettings
    from tests.servers import serve

    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("PBSD_STREAM_PREFIX", key_prefix)
    with serve(create_app(ScorerSettings(model=str(tiny_checkpoint)))) as base:
        answer = _raw(base, _post_head("/health", 200 * 2**20, token=False), b"x" * 1024)
        assert answer.startswith("HTTP/1.1 413"), answer[:200]
        assert httpx.post(f"{base}/metrics", content=b"x" * 1024).status_code == 405
