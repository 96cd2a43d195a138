"""Wire contracts: round trips, rejection of malformed payloads, schema staleness."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest
from pydantic import ValidationError

from proto import (
    PbsdSpec,
    PromptTask,
    RunSpec,
    ScoredGroup,
    Trajectory,
    TrajectoryGroup,
    decode,
    encode,
)
from proto import examples as ex
from proto.messages import DeadLetter, RunEnded, WeightsPublished
from proto.schemas_export import SCHEMA_DIR, render_schemas
from proto.streams import ALL_STREAMS

MESSAGES = [
    ex.example_run(),
    ex.example_run("grpo"),
    ex.example_task(),
    ex.example_group(),
    ex.example_group(2, routed_experts=(4, 2)),
    ex.example_scored(),
    ex.example_weights(),
    ex.example_dead_letter(),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_binary_and_json_round_trip(message):
    model = type(message)
    assert decode(model, encode(message)) == message
    assert model.model_validate_json(message.model_dump_json()) == message
    # the JSON form carries arrays as base64 strings, never as lists of numbers
    assert '"data":[' not in message.model_dump_json().replace(" ", "")


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_the_wire_form_is_one_packb_of_the_dump_though_packed_in_pieces(message):
    """``encode`` packs a piece at a time, so that the event loop of a caller in a thread runs
    between them (one packb of a 200 MB group held it for 0.2 s); the bytes are packb's."""
    from proto.base import PACKED_DEPTH, _packed

    assert encode(message) == msgpack.packb(message.model_dump(mode="python"), use_bin_type=True)
    if isinstance(message, TrajectoryGroup):  # no piece holds more than one trajectory
        pieces = list(_packed(msgpack.Packer(use_bin_type=True), message.model_dump(), PACKED_DEPTH))
        one = max(len(msgpack.packb(t.model_dump(), use_bin_type=True)) for t in message.trajectories)
        assert max(map(len, pieces)) <= one


@pytest.mark.parametrize("scored", [False, True], ids=["group", "scored"])
def test_a_large_array_is_packed_a_mib_at_a_time_wherever_it_lies(scored):
    """A trajectory's routes (here 2.3 MB each) are dumped as copies of a MiB at most, which only
    the join puts together (it lets go of the interpreter; ``tobytes`` and ``packb`` did not), in
    a group's trajectories and a level further down, in a scored group's; the bytes are packb's."""
    from proto.arrays import PIECE_BYTES
    from proto.base import _pieces

    group = ex.example_group(2, tokens=6000, turns=3, prompt_tokens=100, routed_experts=(48, 8))
    message = ex.example_scored(group) if scored else group
    assert group.trajectories[0].routed_experts.nbytes > 2 * PIECE_BYTES
    pieces = list(_pieces(message))
    assert b"".join(pieces) == msgpack.packb(message.model_dump(mode="python"), use_bin_type=True)
    assert max(map(len, pieces)) <= PIECE_BYTES
    assert encode(message) == b"".join(pieces) and decode(type(message), encode(message)) == message


def test_a_value_msgpack_cannot_pack_still_fails_as_packb_does():
    from proto.base import _holds_pieces

    with pytest.raises(TypeError, match="can not serialize 'set' object"):
        _holds_pieces({1})
    with pytest.raises(OverflowError, match="Integer value out of range"):  # an int past 64 bits
        _holds_pieces(2**70)


def test_only_plain_dicts_lists_and_tuples_are_packed_in_pieces():
    """A subclass is packed whole, as packb packs it: msgpack's ExtType is a tuple, but an ext."""
    from collections import OrderedDict, namedtuple

    from proto.base import PACKED_DEPTH, _packed

    pair = namedtuple("pair", "a b")
    value = {"ext": msgpack.ExtType(5, b"xy"), "od": OrderedDict(k=[1, 2]), "nt": pair(1, (2, b"z"))}
    pieces = _packed(msgpack.Packer(use_bin_type=True), value, PACKED_DEPTH)
    assert b"".join(pieces) == msgpack.packb(value, use_bin_type=True)


def test_arrays_are_compact_and_read_only():
    traj = ex.example_trajectory(tokens=4096, prompt_tokens=0)
    wire = encode(traj)
    assert len(wire) < 4096 * (4 + 1 + 4) + 2048  # ids int32 + mask uint8 + logprobs float32 + small fields
    back = decode(Trajectory, wire)
    assert back.completion_ids.dtype == np.int32 and back.rollout_logprobs.dtype == np.float32
    with pytest.raises(ValueError):
        back.completion_ids[0] = 1
    with pytest.raises(ValidationError):
        back.reward = 0.0  # frozen


def test_arrays_accept_lists_and_torch_and_check_ranges():
    import torch

    t = ex.example_trajectory(tokens=6, turns=1, prompt_tokens=2)
    data = t.model_dump()
    data["completion_ids"] = torch.tensor(t.completion_ids.astype(np.int64))
    data["prompt_ids"] = [1, 2]
    assert Trajectory.model_validate(data).prompt_ids.dtype == np.int32
    data["prompt_ids"] = [1, 2**40]
    with pytest.raises(ValidationError, match="do not fit"):
        Trajectory.model_validate(data)
    data["prompt_ids"] = [1.5, 2]
    with pytest.raises(ValidationError, match="expected integers"):
        Trajectory.model_validate(data)


def _traj_dict(**changes):
    data = ex.example_trajectory(tokens=12, turns=2).model_dump()
    data.update(changes)
    return data


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"loss_mask": np.zeros(11, np.uint8)}, "loss_mask has 11 entries"),
        ({"turn_spans": ((0, 4), (3, 8))}, "turn_spans\\[1\\]"),
        ({"turn_spans": ((0, 40),)}, "turn_spans\\[0\\]"),
        ({"loss_mask": np.ones(12, np.uint8)}, "loss_mask must be 1 exactly"),
        ({"finish_reason": "error"}, "must say why"),
        ({"finish_reason": "crashed"}, "finish_reason"),
        ({"reward": float("nan")}, "finite"),
        ({"surprise": 1}, "Extra inputs are not permitted"),
    ],
)
def test_trajectory_rejects_malformed(changes, message):
    with pytest.raises(ValidationError, match=message):
        Trajectory.model_validate(_traj_dict(**changes))


def test_wire_rejections_are_clear():
    with pytest.raises(ValueError, match="not valid msgpack"):
        decode(TrajectoryGroup, b"\xc1garbage")
    with pytest.raises(ValueError, match="must be a map"):
        decode(TrajectoryGroup, msgpack.packb([1, 2]))
    data = ex.example_group(1).model_dump()
    data["schema_version"] = 2
    with pytest.raises(ValidationError, match="schema_version"):
        decode(TrajectoryGroup, msgpack.packb(data, use_bin_type=True))
    data = ex.example_group(1).model_dump()
    data["trajectories"][0]["completion_ids"] = {"dtype": "int32", "shape": [5], "data": b"\x00" * 7}
    with pytest.raises(ValidationError, match="needs 20"):
        decode(TrajectoryGroup, msgpack.packb(data, use_bin_type=True))
    data["trajectories"][0]["completion_ids"] = {"dtype": "float64", "shape": [1], "data": b"\x00" * 8}
    with pytest.raises(ValidationError, match="dtype float64"):
        decode(TrajectoryGroup, msgpack.packb(data, use_bin_type=True))


def test_group_and_scored_consistency():
    g = ex.example_group(3)
    data = g.model_dump()
    data["trajectories"] = [data["trajectories"][0], data["trajectories"][0]]
    with pytest.raises(ValidationError, match="unique"):
        TrajectoryGroup.model_validate(data)
    s = ex.example_scored(g).model_dump()
    s["advantages"] = np.zeros(2, np.float32)
    with pytest.raises(ValidationError, match="advantages has 2"):
        ScoredGroup.model_validate(s)
    s = ex.example_scored(g)
    adv = s.token_advantages(0)
    traj = g.trajectories[0]
    assert np.all(adv[traj.loss_mask == 0] == 0)
    assert np.allclose(adv[traj.loss_mask == 1], s.advantages[0])


def test_run_spec_defaults_are_the_papers():
    spec = RunSpec.model_validate({"model": {"path": "m"}, "data": {"train": "t.jsonl"}})
    assert isinstance(spec.algorithm, PbsdSpec)
    a = spec.algorithm
    assert (a.delta, a.clip, a.eps_pos, a.eps_neg, a.eps_low, a.eps_high) == (
        0.1,
        0.1,
        0.001,
        0.003,
        0.2,
        0.28,
    )
    r, t = spec.rollout, spec.trainer
    assert (r.group_size, r.temperature, r.top_p, r.max_turns, r.max_tokens_per_turn, r.max_context) == (
        8,
        1.0,
        1.0,
        300,
        16384,
        65536,
    )
    assert (t.prompts_per_step, t.lr, t.warmup_steps, t.weight_decay) == (32, 3e-6, 8, 0.1)
    # no KL and no entropy term, the token mean within a sequence and the mean over sequences
    # (1/G sum 1/|tau_i|), s as the turn's mean log-ratio, the evidence with routing computed fresh,
    # no importance correction beyond the clip; evaluation at top-p 0.95, mean@4
    assert (a.kl_coef, a.loss_agg, a.reduce, a.evidence_routing, a.tis_cap) == (
        0.0,
        "seq-mean-token-mean",
        "mean",
        "fresh",
        None,
    )
    assert (r.eval_top_p, r.eval_samples) == (0.95, 4)
    grpo = RunSpec.model_validate(
        {"model": {"path": "m"}, "data": {"train": "t"}, "algorithm": {"name": "grpo"}}
    )
    assert grpo.algorithm.name == "grpo"


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"algorithm": {"name": "ppo"}}, "algorithm"),
        ({"algorithm": {"name": "pbsd", "delta": 0}}, "algorithm.pbsd.delta"),
        ({"algorithm": {"name": "pbsd", "teacher_template": "no fields"}}, "teacher_template"),
        ({"rollout": {"max_tokens_per_turn": 100, "max_context": 10}}, "max_tokens_per_turn"),
        ({"trainer": {"routing_replay": True}}, "return_routed_experts"),
        ({"trainer": {"publish_every": 3}}, "publish_every .3. cannot exceed rollout.max_staleness . 1 .2."),
        ({"rollout": {"temperature": 0}}, "rollout.temperature"),
        ({"rollout": {"temperature": 1e-7}}, "rollout.temperature"),  # SGLang: greedy, log-probs at T=1
        ({"trainer": {"eval_every": 5}}, "eval_every needs data.validation"),
        ({"trainer": {"lr": -1}}, "trainer.lr"),
        # past 2^64 a spec was accepted, then its prompts could not be encoded on the bus
        ({"algorithm": {"name": "pbsd", "teacher_max_length": 10**30}}, "teacher_max_length"),
        ({"algorithm": {"name": "pbsd", "noise_floor_samples": 2**64}}, "noise_floor_samples"),
        ({"trainer": {"max_steps": 10**30}}, "trainer.max_steps"),
        ({"data": {"train": "t", "epochs": 10**30}}, "data.epochs"),
        ({"trainer": {"betas": [0.9, 1.0]}}, "trainer.betas"),  # torch's AdamW refuses it at the run's start
        ({"name": "run\n2026-11-29 INFO forged line"}, "name"),
        ({"name": "\x1b[2Jrun"}, "name"),
        ({"name": "\x9b2Jrun"}, "name"),  # C1 CSI
        ({"name": "run\x85forged"}, "name"),  # NEL: a line break to str.splitlines
        ({"name": "run\u2028forged"}, "name"),
        ({"name": "run\u202egpj.exe"}, "name"),  # right-to-left override
        # pydantic reads true as 1: a group of one sample, a deadband of 1 nat
        ({"rollout": {"group_size": True}}, "group_size: True holds a boolean"),
        ({"algorithm": {"name": "pbsd", "eps_pos": True}}, "eps_pos: True holds a boolean"),
        ({"trainer": {"keep_checkpoints": False}}, "keep_checkpoints: False holds a boolean"),
        ({"trainer": {"betas": [False, 0.9]}}, "betas: .False, 0.9. holds a boolean"),
    ],
)
def test_run_spec_errors_name_the_field(patch, message):
    body = {"model": {"path": "m"}, "data": {"train": "t"}, **patch}
    with pytest.raises(ValidationError, match=message):
        RunSpec.model_validate(body)


def test_run_spec_flags_still_take_booleans():
    body = {"model": {"path": "m"}, "data": {"train": "t"}, "rollout": {"return_routed_experts": True}}
    spec = RunSpec.model_validate(
        {**body, "trainer": {"routing_replay": True, "deepspeed_config": {"x": True}}}
    )
    assert spec.rollout.return_routed_experts and spec.trainer.routing_replay


def test_schemas_are_fresh():
    rendered = render_schemas()
    on_disk = {p.name for p in SCHEMA_DIR.glob("*.json")}
    assert on_disk == set(rendered), "run `pbsd schemas export`"
    for name, text in rendered.items():
        assert (SCHEMA_DIR / name).read_text() == text, f"{name} is stale: run `pbsd schemas export`"


def test_schema_describes_arrays_as_base64_objects():
    schema = json.loads((SCHEMA_DIR / "TrajectoryGroup.json").read_text())
    traj = schema["$defs"]["Trajectory"]["properties"]
    assert traj["completion_ids"]["properties"]["dtype"] == {"const": "int32"}
    assert traj["completion_ids"]["properties"]["data"]["contentEncoding"] == "base64"


def test_every_stream_has_a_distinct_key_and_message_model():
    keys = [s.key("p") for s in ALL_STREAMS]
    assert len(set(keys)) == len(keys)
    assert {s.model for s in ALL_STREAMS} == {
        PromptTask,
        TrajectoryGroup,
        ScoredGroup,
        WeightsPublished,
        RunEnded,
        DeadLetter,
    }
