"""Shared fixtures: one private redis-server for the session, a fresh key prefix per test."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import redis

from services.bus import Bus
from services.local_redis import LocalRedis


@pytest.fixture(scope="session")
def redis_server():
    with LocalRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def key_prefix(redis_server):
    """A prefix unique to this test; its keys are deleted afterwards."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    yield prefix
    client = redis.Redis.from_url(redis_server.url)
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        client.delete(key)
    client.close()


@pytest.fixture
async def bus(redis_url, key_prefix):
    b = Bus.from_url(redis_url, prefix=key_prefix)
    yield b
    await b.close()


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory):
    """A small generated world shared by the tests that need questions and a corpus."""
    from worldgen.build import build_world

    out = tmp_path_factory.mktemp("tiny-world")
    build_world(out, seed=11, entities=1200, n_rl=60, n_val=30, n_sft=60)
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_world, tmp_path_factory):
    """A tiny Qwen3-MoE policy (random weights) with a BPE tokenizer trained on the tiny world."""
    import json

    from agent.catalogue import catalogue
    from agent.prompt import system_prompt
    from services.model.checkpoint import save_checkpoint
    from services.model.tiny import TinySpec, build_tiny_model, train_tokenizer

    texts = [json.loads(line)["text"] for line in (tiny_world / "corpus.jsonl").read_text().splitlines()]
    texts.append(system_prompt(catalogue(), "2025-06-01"))
    tokenizer = train_tokenizer(texts, vocab_size=1024)
    model = build_tiny_model(tokenizer, TinySpec(hidden_size=64, head_dim=16, moe_intermediate_size=64))
    return save_checkpoint(model, tmp_path_factory.mktemp("tiny-ckpt") / "v0", tokenizer=tokenizer)


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory):
    """A very small Qwen3-MoE policy with a tokenizer, built in seconds (no world): 4 experts, so its
    checkpoint layout (one tensor per expert) differs from the fused one transformers holds."""
    from services.model.checkpoint import save_checkpoint
    from services.model.tiny import TinySpec, build_tiny_model, train_tokenizer

    texts = ["the quick brown fox jumps over the lazy dog " * 20, "search the corpus and read pages " * 20]
    tokenizer = train_tokenizer(texts, vocab_size=300)
    spec = TinySpec(vocab_size=300, hidden_size=32, head_dim=8, moe_intermediate_size=16, num_experts=4)
    model = build_tiny_model(tokenizer, spec)
    return save_checkpoint(model, tmp_path_factory.mktemp("moe") / "v0", tokenizer=tokenizer)


TOKEN = "test-token-5b1d"


@pytest.fixture
def api(redis_url, key_prefix, tmp_path, tmp_path_factory):
    """A trainer service (REST API and executor) on a free port, bearer token ``TOKEN``; its data and
    model roots are the test session's temporary folder (the tiny world and checkpoint are there)."""
    from services.trainer.app import create_app
    from tests.servers import serve

    app = create_app(trainer_settings(redis_url, key_prefix, tmp_path, tmp_path_factory))
    with serve(app) as url:
        # a run a test parks as "running" must come after the executor's resume pass, or it is resumed
        deadline = time.monotonic() + 10
        while not app.state.executor.taking_queued:
            assert time.monotonic() < deadline, "the executor did not start"
            time.sleep(0.01)
        yield url


def trainer_settings(redis_url, key_prefix, tmp_path, tmp_path_factory):
    """The settings of the ``api`` fixture's trainer service."""
    from services.trainer.settings import TrainerSettings

    roots = [tmp_path_factory.getbasetemp()]
    return TrainerSettings(
        api_token=TOKEN,
        redis_url=redis_url,
        stream_prefix=key_prefix,
        runs_dir=tmp_path / "runs",
        data_roots=roots,
        model_roots=roots,
    )


@pytest.fixture
async def pipeline(redis_url, key_prefix, tiny_checkpoint, tmp_path):
    """Makes trainer pipelines (tests/trainer_pipeline.py) on this test's Redis prefix; closes them."""
    from tests.trainer_pipeline import Pipeline

    pipelines = []

    def make(**kwargs):
        pipelines.append(Pipeline(redis_url, key_prefix, tiny_checkpoint, tmp_path, **kwargs))
        return pipelines[-1]

    yield make
    for p in pipelines:
        await p.close()


def stub_checkpoint(path: Path, **files) -> Path:
    """A directory with every file the CLI's up-front check wants of a checkpoint, holding no
    weights (nothing can load it); ``files`` replaces one (None leaves it out)."""
    path.mkdir(exist_ok=True)
    contents = {
        "config.json": '{"model_type": "qwen3_moe", "num_hidden_layers": 2}',
        "model.safetensors": (2).to_bytes(8, "little") + b"{}",  # a header listing no tensors
        "tokenizer.json": "{}",
    } | files
    for name, content in contents.items():
        if content is not None:
            (path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


@pytest.fixture(scope="session")
def checkpoint_stub():
    """:func:`stub_checkpoint`, for tests that need a checkpoint the CLI refuses only later."""
    return stub_checkpoint
