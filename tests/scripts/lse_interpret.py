"""Run by tests/test_scorer_kernels.py with ``TRITON_INTERPRET=1``: the fused LM-head kernel, executed by
Triton's CPU interpreter, against the torch reference; exits non-zero on the first mismatch."""

import os

import torch
from torch import nn

from services.model.lm_head import realised_logprobs
from services.model.lse_kernel import logit_and_logsumexp, reference_logit_and_logsumexp

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
torch.manual_seed(0)

# a vocabulary that is not a multiple of the tile, rows far apart in scale, both dtypes
for dtype in (torch.float32, torch.bfloat16):
    for vocab in (1000, 8192 + 77):
        logits = (torch.randn(6, vocab) * torch.tensor([0.01, 1, 5, 30, 100, 1])[:, None]).to(dtype)
        logits[5, 17] = 60.0  # one dominant logit, chosen below
        targets = torch.randint(0, vocab, (6,))
        targets[5] = 17
        got = logit_and_logsumexp(logits, targets)
        want = reference_logit_and_logsumexp(logits, targets)
        for g, w, name in zip(got, want, ("chosen", "lse"), strict=True):
            assert g.dtype == torch.float32, name
            torch.testing.assert_close(g, w, rtol=0, atol=2e-5, msg=f"{name} {dtype} vocab {vocab}")

# the scorer's whole head path: chunks of rows, the realised tokens, fused against chunked
head = nn.Linear(32, 1000, bias=False)
hidden = torch.randn(37, 32)
targets = torch.randint(0, 1000, (37,))
fused = realised_logprobs(hidden, head, targets, chunk_size=16, path="fused")
chunked = realised_logprobs(hidden, head, targets, chunk_size=16, path="chunked")
torch.testing.assert_close(fused, chunked, rtol=0, atol=2e-5)
print("ok")
