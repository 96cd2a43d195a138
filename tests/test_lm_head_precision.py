"""The scorer's LM head in a half-precision model: float32 logits, so that a kernel's rounding of
the hidden state moves a log-prob by what it changes, not by a grid step of bfloat16."""

from __future__ import annotations

import copy
import io

import numpy as np
import torch
from torch import nn

from services.model.lm_head import Float32Head, float32_logits, float32_output, realised_logprobs

VOCAB, WIDTH, ROWS = 512, 64, 256


def _head_and_rows(seed: int = 0) -> tuple[nn.Linear, torch.Tensor]:
    """A bfloat16 head whose logits spread over +-30, as a trained model's do."""
    gen = torch.Generator().manual_seed(seed)
    head = nn.Linear(WIDTH, VOCAB, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, WIDTH, generator=gen) * 1.5)
    rows = torch.randn(ROWS, WIDTH, generator=gen)
    return head.to(torch.bfloat16).requires_grad_(False), rows.to(torch.bfloat16)


def _exact(head: nn.Linear, rows: torch.Tensor, targets: torch.Tensor) -> np.ndarray:
    logits = rows.double() @ head.weight.double().T
    return torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0].numpy()


def _one_ulp_apart(rows: torch.Tensor) -> torch.Tensor:
    """The same rows with one element each moved to its bfloat16 neighbour: the smallest
    difference two kernel layouts (a student and a teacher context) leave in a hidden state."""
    bits = rows.view(torch.int16).clone()
    bits[:, 0] += 1
    return bits.view(torch.bfloat16)


def test_the_scorers_log_probs_are_exact_for_bfloat16_rows_and_head():
    head, rows = _head_and_rows()
    targets = torch.randint(0, VOCAB, (ROWS,), generator=torch.Generator().manual_seed(1))
    got = realised_logprobs(rows, head, targets, chunk_size=100).numpy()
    exact = _exact(head, rows, targets)
    np.testing.assert_allclose(got, exact, atol=2e-5, rtol=0)
    via_bf16 = torch.log_softmax(head(rows).float(), -1).gather(1, targets[:, None])[:, 0].numpy()
    assert np.abs(via_bf16 - exact).max() > 0.02  # the route this replaces: a logit's grid step


def test_a_one_ulp_difference_in_the_hidden_state_moves_the_log_prob_by_what_it_changes():
    """The null pass's situation: the true difference is tiny; bfloat16 logits turn it into 0 or a
    jump of a grid step. The measured d follows the exact one to float32's precision."""
    head, rows = _head_and_rows(seed=2)
    moved = _one_ulp_apart(rows)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=torch.Generator().manual_seed(3))
    d = (realised_logprobs(moved, head, targets, 64) - realised_logprobs(rows, head, targets, 64)).numpy()
    exact = _exact(head, moved, targets) - _exact(head, rows, targets)
    assert np.abs(exact).max() < 0.1  # what one ulp of one element can change
    np.testing.assert_allclose(d, exact, atol=2e-5, rtol=0)

    def via_bf16(r):
        return torch.log_softmax(head(r).float(), -1).gather(1, targets[:, None])[:, 0]

    rounded = (via_bf16(moved) - via_bf16(rows)).numpy()
    assert np.std(rounded - exact) > 5 * np.std(d - exact)


def test_the_cuda_route_multiplies_in_half_precision_into_float32():
    """On CUDA the product runs at bfloat16 speed with float32 output (torch.mm's out_dtype);
    the meta device checks the call's shapes and types here."""
    head = nn.Linear(WIDTH, VOCAB, bias=False, device="meta", dtype=torch.bfloat16)
    logits = float32_logits(head, torch.empty(8, WIDTH, device="meta", dtype=torch.bfloat16))
    assert logits.dtype == torch.float32 and logits.shape == (8, VOCAB)


def test_a_head_with_a_bias_or_not_linear_gives_float32_logits():
    head, rows = _head_and_rows()
    biased = nn.Linear(WIDTH, VOCAB).to(torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
    exact = rows.double() @ head.weight.double().T + biased.bias.double()
    got = float32_logits(biased, rows)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), exact.numpy(), atol=1e-4, rtol=0)
    wrapped = nn.Sequential(head)  # called as it is, then upcast
    assert float32_logits(wrapped, rows).dtype == torch.float32


def test_the_trainers_head_gives_float32_logits_and_the_gradients_bfloat16_gave():
    """float32_output: the forward is the scorer's exact product; the backward is the one autograd
    runs for head(rows).float() (the logits' gradient rounded to bfloat16, then the products), so
    a training step changes only by the logits it sees."""
    head, rows = _head_and_rows(seed=4)
    head.requires_grad_(True)
    upstream = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(6))

    def run(module):
        x = rows.clone().requires_grad_(True)
        module.weight.grad = None
        logits = module(x)
        (logits.float() * upstream).sum().backward()
        return logits, x.grad, module.weight.grad

    plain_logits, plain_rows_grad, plain_weight_grad = run(head)
    float32_output(head)
    logits, rows_grad, weight_grad = run(head)
    assert plain_logits.dtype == torch.bfloat16 and logits.dtype == torch.float32
    exact = rows.double() @ head.weight.detach().double().T
    np.testing.assert_allclose(logits.detach().numpy(), exact.numpy(), atol=1e-4, rtol=0)
    assert (plain_logits.float() - exact).abs().max() > 0.05
    torch.testing.assert_close(rows_grad, plain_rows_grad, rtol=0, atol=0)
    torch.testing.assert_close(weight_grad, plain_weight_grad, rtol=0, atol=0)


def test_a_float32_head_is_left_as_it_is_and_a_float32head_pickles_and_copies():
    assert type(float32_output(nn.Linear(WIDTH, VOCAB))) is nn.Linear
    head, rows = _head_and_rows()
    float32_output(head)
    assert isinstance(head, Float32Head) and isinstance(head, nn.Linear)
    buffer = io.BytesIO()
    torch.save(head, buffer)
    buffer.seek(0)
    for again in (torch.load(buffer, weights_only=False), copy.deepcopy(head)):
        assert type(again) is Float32Head
        torch.testing.assert_close(again(rows), head(rows), rtol=0, atol=0)
    assert float32_output(head) is head and type(head) is Float32Head  # twice: the same


def test_the_in_process_engines_bfloat16_head_gives_float32_logits_in_both_modes(tiny_checkpoint):
    """The rollout's log-probs (pi_old in the ratio) come from float32 logits too, whether a forward
    decodes batch-invariantly or not, so the trainer's ratio compares float32 with float32."""
    from services.model.checkpoint import load_model
    from services.rollout import rowwise

    model = load_model(tiny_checkpoint, dtype="bfloat16")
    rowwise.install(model)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        with rowwise.batch_invariant():
            blocked = model(input_ids=ids).logits
    exact = out.hidden_states[-1].double() @ model.lm_head.weight.detach().double().T
    for logits in (out.logits, blocked):
        assert logits.dtype == torch.float32
        np.testing.assert_allclose(logits.double().numpy(), exact.numpy(), atol=1e-4, rtol=0)
