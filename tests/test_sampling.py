"""The sampler's exponential draws are torch's own, bit for bit, and leave each generator where
torch's leave it: a seed gives the tokens it gave before the faster draw."""

import pytest
import torch

from services.rollout.sampling import exponential_draws


@pytest.mark.parametrize("n", [7, 4096, 151_936])  # a toy size, the lab's vocabulary, Qwen3's
def test_draws_are_torchs_exponential_bit_for_bit(n):
    rows = 4 if n > 10_000 else 64
    ours = [torch.Generator().manual_seed(seed) for seed in range(rows)]
    torchs = [torch.Generator().manual_seed(seed) for seed in range(rows)]
    for _ in range(3):  # and the generators stay in step across calls
        got = exponential_draws(ours, n)
        want = torch.stack([torch.empty(n).exponential_(generator=g) for g in torchs])
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        assert torch.equal(got, want)
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(ours, torchs, strict=True))
