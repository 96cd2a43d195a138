"""The scorer's kernel paths: flex attention's document mask, packed against unpacked, the fused LM
head against torch, one path per call for student and teacher, and the deadband arithmetic.

Flex attention runs here under ``torch.compiler.set_stance("force_eager")``: its unfused
implementation, the same mask and the same transformers integration as the compiled kernel.
On CPU, compiling it costs about half a minute per packed length, and with torch 2.13 the
second length (a dynamic-shape recompile) fails in the generated C++; the compiled kernel is
checked for one length under ``slow`` and for many on CUDA in tests/test_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._inductor.exc import InductorError
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

from agent.chat import ChatTokenizer
from proto.runs import PbsdSpec
from services.model.checkpoint import load_model
from services.scorer import logprobs as logprobs_module
from services.scorer.backends import LocalScorer
from services.scorer.evidence import score_group
from services.scorer.logprobs import document_block_mask, kernel_path, sequence_logprobs, static_length
from services.scorer.numerics import token_differences, turn_shifts
from tests.test_scorer import TEMPLATE, _trajectory, group_of

# flex attention runs eagerly on CPU here (its unfused path is the reference the tests want), and
# importing it touches torch.jit's deprecated script_method: both warnings are expected
pytestmark = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sdpa_model(tiny_checkpoint):
    return load_model(tiny_checkpoint)


@pytest.fixture(scope="module")
def flex_model(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    model.set_attn_implementation("flex_attention")
    return model


@pytest.fixture
def eager_flex():
    with torch.compiler.set_stance("force_eager"):
        yield


def _requests(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 900, n).tolist(), np.arange(1, n)) for n in lengths]


def test_document_mask_is_causal_within_each_sequence_only():
    lengths = [5, 130, 1, 200]
    mask = document_block_mask(lengths, "cpu")
    n = sum(lengths)
    dense = create_mask(mask.mask_mod, 1, 1, n, n, device="cpu")[0, 0]
    doc = np.repeat(np.arange(len(lengths)), lengths)
    q, k = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    np.testing.assert_array_equal(dense.numpy(), (k <= q) & (doc[q] == doc[k]))


def test_document_mask_skips_blocks_between_sequences():
    # 128-token blocks; sequences of 256 and 128 tokens: q-block 1 sees kv-block 0 whole (full) and its own
    # diagonal block (partial); q-block 2 (the second sequence) sees only its diagonal, nothing of the first
    mask = document_block_mask([256, 128], "cpu")
    assert mask.kv_num_blocks[0, 0].tolist() == [1, 1, 1]
    assert mask.full_kv_num_blocks[0, 0].tolist() == [0, 1, 0]


def test_document_mask_has_create_block_masks_blocks():
    """The block lists computed from the lengths equal those create_block_mask finds by evaluating the
    mask, on sequences that end on, inside and across 128-token blocks."""
    rng = np.random.default_rng(3)
    cases = [[128], [1], [256, 128], [5, 130, 1, 200], [127, 1, 128, 129]]
    cases += [rng.integers(1, 400, rng.integers(1, 12)).tolist() for _ in range(20)]
    for lengths in cases:
        ours = document_block_mask(lengths, "cpu")
        n = sum(lengths)
        theirs = create_block_mask(ours.mask_mod, 1, None, n, n, device="cpu")
        for counts, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
            a, b = getattr(ours, counts)[0, 0], getattr(theirs, counts)[0, 0]
            assert a.tolist() == b.tolist(), (lengths, counts)
            for row, m in enumerate(a.tolist()):
                got, want = getattr(ours, indices)[0, 0, row, :m], getattr(theirs, indices)[0, 0, row, :m]
                assert sorted(got.tolist()) == sorted(want.tolist()), (lengths, indices, row)


def test_kernel_path_follows_the_attention_implementation(sdpa_model, flex_model):
    assert kernel_path(sdpa_model) == logprobs_module.KernelPath("sdpa", False, "chunked", torch.float32)
    assert kernel_path(flex_model).pack and kernel_path(flex_model).attention == "flex_attention"
    assert kernel_path(flex_model, pack=False).pack is False  # an explicit setting wins
    assert kernel_path(sdpa_model).head == "chunked"  # no fused head without CUDA ...
    with pytest.raises(ValueError, match="needs CUDA"):  # ... and asking for it fails at once
        kernel_path(sdpa_model, head="fused")


def test_packed_flex_equals_unpacked_sdpa(sdpa_model, flex_model, eager_flex):
    requests = _requests((300, 37, 150, 90, 5, 2))
    single = sequence_logprobs(sdpa_model, requests)
    # three packed forwards of different lengths: [300, 90, 5, 2], [150, 37] with a budget of 400
    packed = sequence_logprobs(flex_model, requests, token_budget=400, chunk_size=16)
    assert kernel_path(flex_model).pack
    for a, b in zip(single, packed, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def _spy_on_forwards(model, monkeypatch):
    """Record what each forward and each LM-head reduction of ``model`` actually ran with."""
    forwards, heads = [], []

    def before(module, args, kwargs):
        pos = kwargs["position_ids"][0]
        mask = kwargs.get("attention_mask")
        forwards.append(
            {
                "mask": type(mask).__name__,
                "documents": int((pos == 0).sum()),
                "length": int(pos.numel()),
                "dtype": module.embed_tokens.weight.dtype,
            }
        )

    real = logprobs_module.realised_logprobs

    def reduction(hidden, head, targets, chunk_size, path="chunked"):
        heads.append((path, hidden.dtype))
        return real(hidden, head, targets, chunk_size, path)

    monkeypatch.setattr(logprobs_module, "realised_logprobs", reduction)
    handle = model.model.register_forward_pre_hook(before, with_kwargs=True)
    return forwards, heads, handle


@pytest.mark.parametrize("attention", ["sdpa", "flex_attention"])
async def test_student_and_teacher_always_share_one_kernel_path(
    attention, sdpa_model, flex_model, tiny_checkpoint, monkeypatch, eager_flex
):
    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    model = flex_model if attention == "flex_attention" else sdpa_model
    turns = [["short"], ["a much longer turn " * 30, "and another one " * 20], ["mid length turn " * 8]]
    group = group_of(
        [_trajectory(tok, t, i=i) for i, t in enumerate(turns)], PbsdSpec(teacher_template=TEMPLATE)
    )
    lengths = [len(t.prompt_ids) + len(t.completion_ids) for t in group.trajectories]
    # a budget that holds the longest student but not its teacher (longer by the template): the teacher
    # runs in a forward of its own while the students share theirs, on the same kernel path
    budget = max(lengths) + 2
    forwards, heads, handle = _spy_on_forwards(model, monkeypatch)
    try:
        scored = await score_group(group, tok, LocalScorer(model, token_budget=budget))
    finally:
        handle.remove()
    assert scored.diagnostics.scored_turns == 4
    assert len({(f["mask"], f["dtype"]) for f in forwards}) == 1
    assert len(set(heads)) == 1
    if attention == "flex_attention":
        assert forwards[0]["mask"] == BlockMask.__name__
        counts = sorted(f["documents"] for f in forwards)
        # one sequence alone, several packed, each padded by a document of its own to a static length
        assert counts[0] <= 2 < counts[-1]
        assert all(f["length"] == static_length(f["length"]) for f in forwards)
    else:
        assert all(f["mask"] == "NoneType" and f["documents"] == 1 for f in forwards)
        # a student and a teacher pass per trajectory, and the null pass's sequences (the noise floor)
        assert len(forwards) == 2 * len(group.trajectories) + group.algorithm.noise_floor_samples


async def test_a_flex_compile_failure_moves_the_scorer_to_sdpa_for_the_whole_call(
    sdpa_model, tiny_checkpoint, monkeypatch
):
    """Inductor found no flex kernel for the tiny policy's bf16 heads on an H100 (benchmarks/README.md,
    GPU): the scorer then redoes the call on SDPA, one sequence per forward, and stays there."""
    model = load_model(tiny_checkpoint)
    model.set_attn_implementation("flex_attention")
    real = logprobs_module.decoder_hidden_states
    attempts = []

    def hidden_states(base, ids, lengths, path):
        attempts.append(path.attention)
        if path.attention == "flex_attention":
            raise InductorError(RuntimeError("NoValidChoicesError: No choices to select"), None)
        return real(base, ids, lengths, path)

    monkeypatch.setattr(logprobs_module, "decoder_hidden_states", hidden_states)
    scorer = LocalScorer(model, token_budget=400)
    assert scorer.path.attention == "flex_attention" and scorer.path.pack
    requests = _requests([300, 37, 150, 90, 5])
    got = await scorer(requests)
    assert attempts[0] == "flex_attention" and set(attempts[1:]) == {"sdpa"}
    assert (scorer.path.attention, scorer.path.pack) == ("sdpa", False)
    want = sequence_logprobs(sdpa_model, requests, pack=False)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    attempts.clear()
    await scorer(requests[:2])
    assert attempts == ["sdpa", "sdpa"]  # no second try of the kernel that failed


async def test_other_compile_failures_are_not_swallowed(sdpa_model, monkeypatch):
    def broken(*args):
        raise InductorError(RuntimeError("boom"), None)

    monkeypatch.setattr(logprobs_module, "decoder_hidden_states", broken)
    with pytest.raises(InductorError):
        await LocalScorer(sdpa_model)(_requests([20]))


def test_fused_head_matches_torch_under_tritons_interpreter():
    pytest.importorskip(
        "triton", reason="Triton ships with CUDA builds of torch; pip install triton to run here"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "scripts" / "lse_interpret.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_turn_shifts_by_hand():
    # the teacher path moves every token by +0.002, the student's by +0.0005: a same-path switch moves
    # every turn by 0.0015 (over eps+ = 0.001, under eps- = 0.003); a mixed one by the teacher's 0.002
    student = [np.full(40, 0.0005)]
    teacher = [np.full(40, 0.002)]
    (same,) = turn_shifts(student, teacher, (16,))
    assert same.turns == 2  # 40 tokens: two whole 16-token turns, the rest dropped
    assert same.median_abs == pytest.approx(0.0015) and same.max_abs == pytest.approx(0.0015)
    assert same.over_eps_pos == 1.0 and same.over_eps_neg == 0.0
    (mixed,) = turn_shifts(student, teacher, (16,), mixed=True)
    assert mixed.median_abs == pytest.approx(0.002)
    # alternating errors cancel over a turn: +-0.01 per token, mean 0 over any even-length turn
    alternating = [np.tile([0.01, -0.01], 32)]
    (cancel,) = turn_shifts([np.zeros(64)], alternating, (64,))
    assert cancel.max_abs == pytest.approx(0.0, abs=1e-12) and cancel.over_eps_pos == 0.0
    d = token_differences([np.zeros(3)], [np.array([0.1, -0.3, 0.2])])
    assert d == pytest.approx({"tokens": 3, "max_abs": 0.3, "mean_abs": 0.2, "mean": 0.0})


@pytest.mark.slow
def test_compiled_flex_on_cpu_equals_unpacked_at_every_packed_length(sdpa_model, flex_model):
    """Several packed lengths per call and across calls: with symbolic lengths Inductor's CPU flex
    kernel failed to compile (torch 2.13), so each forward is padded to a static length."""
    requests = _requests((300, 37, 150, 90, 5, 700, 2))
    single = sequence_logprobs(sdpa_model, requests)
    for budget in (400, 750, 10_000):
        packed = sequence_logprobs(flex_model, requests, token_budget=budget)
        for a, b in zip(single, packed, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_static_lengths_are_few_and_waste_at_most_a_quarter():
    lengths = {n: static_length(n) for n in range(1, 40_000)}
    assert all(n <= m <= max(n + 127, 1.25 * n) and m % 128 == 0 for n, m in lengths.items())
    assert len({m for n, m in lengths.items() if 4096 < n <= 8192}) == 4
    assert static_length(16_384) == 16_384 and static_length(16_385) == 20_480


def test_flash_attention_is_chosen_only_where_it_runs(monkeypatch):
    """flash_attn's kernels take half precision only: a float32 scorer on CUDA (the settings'
    default dtype) with flash_attn installed gets flex attention, not a model that fails its first
    forward. On CPU the default (SDPA) whatever is installed."""
    import importlib.util

    from transformers.utils import is_torch_flex_attn_available

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real(name, *a)
    )
    assert logprobs_module.scoring_attention("cuda", "bfloat16") == "flash_attention_2"
    assert logprobs_module.scoring_attention("cuda", "float16") == "flash_attention_2"
    flex = "flex_attention" if is_torch_flex_attn_available() else None
    assert logprobs_module.scoring_attention("cuda", "float32") == flex
    assert logprobs_module.scoring_attention("cpu", "bfloat16") is None
