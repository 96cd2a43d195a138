"""Weights in memory: the checkpoint layout, and a broadcast over gloo that leaves an SGLang stand-in,
the scorer's model and the in-process engine bitwise equal to the trainer's, version after version,
with a receiver killed and restarted between two versions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from proto.messages import WeightsPublished
from proto.streams import WEIGHTS
from services.local_redis import free_port
from services.model.checkpoint import load_model, load_weights_into, save_checkpoint
from services.trainer.checkpoints import TrainState
from services.trainer.publishing import WeightPublisher
from services.weights import layout as layout_module
from services.weights.layout import HubLayout, Piece, digest
from services.weights.sender import MAX_BUCKET_TENSORS, WeightBroadcaster, buckets
from tests.servers import wait_http

ROOT = Path(__file__).resolve().parents[1]
FIRST = "model.embed_tokens.weight"


@pytest.fixture
def checkpoint(moe_checkpoint) -> Path:
    return moe_checkpoint


class Trainer:
    """What the publisher reads of a trainer: its model, and the checkpoint writer."""

    def __init__(self, path: Path) -> None:
        self.model = load_model(path)
        self.generator = torch.Generator().manual_seed(0)

    def step(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=self.generator) * 1e-2)

    def save_weights(self, path, *, tokenizer=None, meta=None) -> Path:
        return save_checkpoint(self.model, path, tokenizer=tokenizer, meta=meta)

    def digest(self) -> str:
        return HubLayout(self.model).digest(self.model)


# -- the layout -------------------------------------------------------------------------------------
def test_the_layout_names_and_addresses_exactly_what_the_checkpoint_holds(checkpoint):
    model = load_model(checkpoint)
    layout = HubLayout(model)
    on_disk = load_file(str(checkpoint / "model.safetensors"))
    assert {p.name for p in layout.pieces} == set(on_disk)
    assert any(".experts.3.up_proj." in p.name for p in layout.pieces)  # fused in memory, one by one here
    state = model.state_dict()
    for piece in layout.pieces:
        assert torch.equal(layout.view(state, piece), on_disk[piece.name]), piece.name
        if piece.index is None:  # a view: it shares the parameter's memory
            assert layout.view(state, piece).untyped_storage().data_ptr() == state[piece.param].data_ptr()
    assert layout.digest(model) == digest(on_disk.items())


def test_the_row_shortcut_finds_what_probing_every_element_finds(checkpoint, monkeypatch):
    model = load_model(checkpoint)
    shortcut = HubLayout(model)
    monkeypatch.setattr(layout_module, "_rows", lambda *args: None)
    every = HubLayout(model)
    assert [(p.name, p.param, p.shape, p.start, p.index) for p in shortcut.pieces] == [
        (p.name, p.param, p.shape, p.start, p.index) for p in every.pieces
    ]


def test_writing_the_checkpoint_tensors_in_place_equals_loading_the_checkpoint(checkpoint):
    loaded, written = load_model(checkpoint), load_model(checkpoint)
    with torch.no_grad():
        for p in [*loaded.parameters(), *written.parameters()]:
            p.mul_(0.5)
    load_weights_into(loaded, checkpoint)
    layout, state = HubLayout(written), written.state_dict()
    for name, tensor in load_file(str(checkpoint / "model.safetensors")).items():
        layout.write(state, layout.by_name[name], tensor)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), state.values(), strict=True))
    with pytest.raises(ValueError, match="shape"):
        layout.write(state, layout.pieces[0], torch.zeros(3))


def test_buckets_keep_order_and_size():
    pieces = [Piece(f"t{i}", "p", (n,), torch.float32) for i, n in enumerate([10, 10, 30, 5, 5])]
    sizes = [[p.name for p in b] for b in buckets(pieces, 80)]
    assert sizes == [["t0", "t1"], ["t2"], ["t3", "t4"]]  # 40 + 40 bytes, 120 alone, 20 + 20
    names = [f"model.layers.{i // 128}.mlp.experts.{i % 128}.down_proj.weight" for i in range(600)]
    many = [Piece(name, "p", (2048, 768), torch.bfloat16) for name in names]
    counts = [len(b) for b in buckets(many, 8 << 30)]  # 8 GB buckets of 3 MiB experts: capped by count
    assert counts == [MAX_BUCKET_TENSORS, MAX_BUCKET_TENSORS, 600 - 2 * MAX_BUCKET_TENSORS]
    body = json.dumps(
        {
            "names": [p.name for p in many[:MAX_BUCKET_TENSORS]],
            "dtypes": ["bfloat16"] * MAX_BUCKET_TENSORS,
            "shapes": [[2048, 768]] * MAX_BUCKET_TENSORS,
            "group_name": "weight_update_group",
            "flush_cache": False,
            "weight_version": "123456",
        }
    )
    assert len(body) < 64 * 1024  # what the workers' receivers accept


# -- a broadcast to real receivers -----------------------------------------------------------------
class Receivers:
    """Receiver processes on loopback: the SGLang stand-in, the in-process engine behind the weight
    routes, and the scorer service itself (``pbsd serve scorer``, on the bus, taking broadcasts)."""

    def __init__(self, checkpoint: Path, redis_url: str = "", prefix: str = "") -> None:
        self.checkpoint = checkpoint
        kinds = ("sglang", "engine", "scorer", "mismatched", "sglang-old", "sglang-left-open")
        self.ports = {kind: free_port() for kind in kinds}
        self.env = {
            **os.environ,
            "REDIS_URL": redis_url,
            "PBSD_STREAM_PREFIX": prefix,
            "PBSD_SCORER_MODEL": str(checkpoint),
            "PBSD_SCORER_ACCEPT_BROADCAST": "true",
            "PBSD_SCORER_WORKER_NAME": "scorer-w",
            "PBSD_LOG_LEVEL": "WARNING",
        }
        self.processes: dict[str, subprocess.Popen] = {}

    def url(self, kind: str) -> str:
        return f"http://127.0.0.1:{self.ports[kind]}"

    def start(self, *kinds: str) -> None:
        for kind in kinds:
            port = str(self.ports[kind])
            command = {
                "sglang": ["-m", "tests.sglang_weights_fake", str(self.checkpoint), port],
                # an SGLang server whose model lacks the first tensor sent
                "mismatched": [
                    "-m",
                    "tests.sglang_weights_fake",
                    str(self.checkpoint),
                    port,
                    "--lacking",
                    FIRST,
                ],
                # SGLang before 0.5.23, without weight-update sessions
                "sglang-old": [
                    "-m",
                    "tests.sglang_weights_fake",
                    str(self.checkpoint),
                    port,
                    "--no-sessions",
                ],
                # a server an earlier publisher left with its session open
                "sglang-left-open": [
                    "-m",
                    "tests.sglang_weights_fake",
                    str(self.checkpoint),
                    port,
                    "--session-open",
                ],
                "engine": ["-m", "tests.weights_receiver_app", "engine", str(self.checkpoint), port],
                "scorer": ["-m", "pbsd.cli", "serve", "scorer", "--port", port],
            }[kind]
            self.processes[kind] = subprocess.Popen([sys.executable, *command], cwd=ROOT, env=self.env)
        for kind in kinds:  # the scorer answers 200 once its worker follows the bus
            wait_http(self.url(kind) + "/health", timeout=180)

    def kill(self, kind: str) -> None:
        process = self.processes.pop(kind)
        process.send_signal(signal.SIGKILL)
        process.wait()

    def close(self) -> None:
        for kind in list(self.processes):
            self.kill(kind)

    async def digests(self) -> dict[str, tuple[str, str]]:
        async with httpx.AsyncClient(timeout=60) as http:
            out = {}
            for kind in self.processes:
                d = (await http.get(self.url(kind) + "/weights_digest")).json()
                out[kind] = (d["weight_version"], d["sha256"])
            return out


@pytest.fixture
def receivers(checkpoint, redis_url, key_prefix):
    r = Receivers(checkpoint, redis_url, key_prefix)
    try:
        yield r
    finally:
        r.close()


class Run:
    """The trainer's side of a run: its model, publisher and state."""

    def __init__(self, checkpoint: Path, bus, out: Path, urls: list[str], timeline: str = "") -> None:
        self.trainer = Trainer(checkpoint)
        self.bus = bus
        broadcaster = WeightBroadcaster(urls, master_address="127.0.0.1", bucket_bytes=32 << 10, timeout_s=60)
        self.publisher = WeightPublisher(bus, "run-w", out, keep=2, broadcaster=broadcaster)
        (out / "weights").mkdir()
        self.state = TrainState(timeline=timeline)

    async def publish(self) -> WeightsPublished:
        self.trainer.step()
        self.state.step += 1
        self.state.version += 1
        await self.publisher.publish(self.trainer, None, self.state)
        return (await self.bus.latest(WEIGHTS))[1]

    def expected(self, tagged: bool = False) -> tuple[str, str]:
        """What a receiver reports: SGLang the tag it was sent, ours the bare number."""
        version = f"{self.state.version}@{self.state.timeline}" if tagged else str(self.state.version)
        return version, self.trainer.digest()


async def test_versions_reach_the_sglang_stand_in_and_the_engine_bitwise(
    receivers, checkpoint, bus, tmp_path
):
    receivers.start("sglang", "engine")
    urls = [receivers.url("sglang"), receivers.url("engine")]
    run = Run(checkpoint, bus, tmp_path, urls, timeline="t1")
    await run.publisher.announce(run.state, str(checkpoint))
    try:
        for _ in range(2):
            event = await run.publish()
            assert (event.transport, event.version) == ("broadcast", run.state.version)
            assert (event.path, event.path_version) == (str(checkpoint), 0)  # no new copy on disk
            # each judged current by its own tag: the group stays as it was formed (one init, below)
            assert await receivers.digests() == {
                "sglang": run.expected(tagged=True),
                "engine": run.expected(),
            }
        async with httpx.AsyncClient(timeout=60) as http:
            generated = (await http.post(receivers.url("engine") + "/generate")).json()
            control = (await http.get(receivers.url("sglang") + "/control")).json()
        assert generated["weight_version"] == 2 and len(generated["output_ids"]) == 4  # the engine resumed
    finally:
        await run.publisher.aclose()
    # SGLang's side saw its protocol: one group; pause, a session around the buckets (the version and
    # the cache flush with the last only), continue
    routes = [route for route, _ in control]
    assert routes.count("init_weights_update_group") == 1 and routes[-1] == "continue_generation"
    last = max(i for i, r in enumerate(routes) if r == "pause_generation")
    assert control[last][1] == {"mode": "retract"}
    updates = [body for route, body in control[last:] if route == "update_weights_from_distributed"]
    assert len(updates) > 1
    assert routes[last:] == [
        "pause_generation",
        "begin_weight_update",
        *["update_weights_from_distributed"] * len(updates),
        "end_weight_update",
        "continue_generation",
    ]
    assert [u.get("weight_version") for u in updates] == [None] * (len(updates) - 1) + ["2@t1"]
    assert [u["flush_cache"] for u in updates] == [False] * (len(updates) - 1) + [True]
    assert {d for u in updates for d in u["dtypes"]} == {"float32"}


async def test_a_server_without_sessions_and_one_left_in_a_session_take_versions_bitwise(
    receivers, checkpoint, bus, tmp_path
):
    """SGLang before 0.5.23 has no session routes (404: nothing to open); a server whose session an
    earlier publisher left open refuses the begin until that session is closed."""
    kinds = ("sglang-old", "sglang-left-open")
    receivers.start(*kinds)
    run = Run(checkpoint, bus, tmp_path, [receivers.url(k) for k in kinds])
    await run.publisher.announce(run.state, str(checkpoint))
    try:
        for _ in range(2):
            event = await run.publish()
            assert event.transport == "broadcast"
            assert await receivers.digests() == dict.fromkeys(kinds, run.expected())
        async with httpx.AsyncClient(timeout=60) as http:
            left_open = [
                r for r, _ in (await http.get(receivers.url("sglang-left-open") + "/control")).json()
            ]
    finally:
        await run.publisher.aclose()
    sessions = [r for r in left_open if r.endswith("_weight_update")]
    assert sessions == [
        "begin_weight_update",
        "end_weight_update",
        "begin_weight_update",
        "end_weight_update",
    ] + [
        "begin_weight_update",
        "end_weight_update",
    ]


@pytest.mark.slow
async def test_the_scorer_killed_between_versions_falls_back_to_disk_and_rejoins(
    receivers, checkpoint, bus, tmp_path
):
    receivers.start("sglang", "scorer", "engine")
    run = Run(checkpoint, bus, tmp_path, [receivers.url(k) for k in ("sglang", "scorer", "engine")])
    await run.publisher.announce(run.state, str(checkpoint))
    everyone = ("sglang", "scorer", "engine")
    try:
        for _ in range(2):
            await run.publish()
            assert await receivers.digests() == dict.fromkeys(everyone, run.expected())

        receivers.kill("scorer")  # between versions 2 and 3
        event = await run.publish()
        assert (event.transport, event.path_version) == ("broadcast", 3)  # written for the one that missed it
        assert digest(load_file(str(Path(event.path) / "model.safetensors")).items()) == run.trainer.digest()
        assert await receivers.digests() == dict.fromkeys(("sglang", "engine"), run.expected())

        receivers.start("scorer")  # it catches up from the newest publication: the disk copy of version 3
        assert (await receivers.digests())["scorer"] == run.expected()

        event = await run.publish()  # and takes version 4 in the group again
        assert (event.transport, event.path_version) == ("broadcast", 3)  # nobody missed version 4
        assert await receivers.digests() == dict.fromkeys(everyone, run.expected())
        async with httpx.AsyncClient(timeout=60) as http:
            control = (await http.get(receivers.url("sglang") + "/control")).json()
    finally:
        await run.publisher.aclose()
    # formed; re-formed without the scorer; and with it again
    assert [route for route, _ in control].count("init_weights_update_group") == 3


async def test_no_receiver_up_means_the_disk(checkpoint, bus, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    publisher = WeightPublisher(
        bus, "run-d", tmp_path, keep=2, broadcaster=WeightBroadcaster([url], master_address="127.0.0.1")
    )
    (tmp_path / "weights").mkdir()
    state = TrainState(step=1, version=1)
    try:
        await publisher.publish(Trainer(checkpoint), None, state)
    finally:
        await publisher.aclose()
    event = (await bus.latest(WEIGHTS))[1]
    assert event.transport == "disk" and Path(event.path) == tmp_path / "weights" / "v000001"
    meta = json.loads((Path(event.path) / "pbsd.json").read_text())
    assert meta == {"run_id": "run-d", "step": 1, "version": 1}


def test_a_broadcast_publication_points_at_an_older_copy_only():
    base = {"run_id": "r", "step": 5, "path": "/ckpt/step-4/model"}
    event = WeightsPublished(**base, version=5, transport="broadcast", path_version=4)
    assert event.disk_copy().version == 4 and event.disk_copy().transport == "disk"
    assert WeightsPublished(**base, version=5).disk_copy().version == 5
    with pytest.raises(ValueError, match="newer"):
        WeightsPublished(**base, version=3, transport="broadcast", path_version=4)
    with pytest.raises(ValueError, match="disk publication"):
        WeightsPublished(**base, version=5, path_version=4)


@pytest.mark.slow
async def test_a_broadcast_broken_half_way_goes_to_disk_and_leaves_the_others_torn(
    receivers, checkpoint, bus, tmp_path
):
    receivers.start("mismatched", "engine")
    run = Run(checkpoint, bus, tmp_path, [receivers.url("mismatched"), receivers.url("engine")])
    assert run.publisher.broadcaster.layout(run.trainer.model).pieces[0].name == FIRST
    await run.publisher.announce(run.state, str(checkpoint))
    try:
        event = await run.publish()  # the first bucket fails on the mismatched server
    finally:
        await run.publisher.aclose()
    assert (event.transport, event.version) == ("disk", 1)
    assert digest(load_file(str(Path(event.path) / "model.safetensors")).items()) == run.trainer.digest()
    async with httpx.AsyncClient(timeout=60) as http:
        engine = (await http.get(receivers.url("engine") + "/model_info")).json()
        control = (await http.get(receivers.url("mismatched") + "/control")).json()
    assert engine["weight_version"] == "-1"  # torn: its worker reloads the disk copy the event names
    # the server was kept paused until it had loaded the whole version from disk
    assert [route for route, _ in control][-4:] == [
        "destroy_weights_update_group",
        "end_weight_update",  # the session the failed version opened, closed
        "update_weights_from_disk",
        "continue_generation",
    ]
    assert control[-2][1] == {"model_path": event.path, "weight_version": "1", "flush_cache": True}
