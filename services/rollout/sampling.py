"""Sampling one token for each row of a batch of logits, each row from its own generator.

Semantics are SGLang's: the log-prob is that of the temperature-scaled distribution, top-p
keeps the smallest set of likeliest tokens whose mass reaches ``top_p`` (the top token always),
temperature 0 is greedy. The draw is the one ``torch.multinomial`` makes for a single sample:

    q_v ~ Exp(1) for every token v of the vocabulary (from the row's generator)
    token = argmax_v p_v / q_v           (p: the nucleus, unnormalised: the argmax ignores scale)

Every operation works along a row and gives a row the same bits whatever else is in the batch
(checked in tests/test_inprocess_engine.py), and each row draws only from its own generator, so
a request's tokens depend on its seed, never on which requests shared its batch.

The draws are the ones ``Tensor.exponential_`` makes, bit for bit, at 2.5 times its speed on
CPU: it takes a float64 uniform ``u`` from the generator per token and returns
``-log1p(-u)`` rounded to float32, one element at a time; :func:`exponential_draws` takes the
same uniforms in one ``torch.rand`` call and transforms them vectorised (the float32 rounding
absorbs any last-bit difference of the float64 logarithm: tests/test_sampling.py compares
millions of draws).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["NUCLEUS_CANDIDATES", "exponential_draws", "nucleus", "sample_rows"]

# Tokens the nucleus is first looked for among: sorting the whole vocabulary for every sampled
# token is a third of an evaluation's time here (top-p 0.95, a 4096-token vocabulary).
NUCLEUS_CANDIDATES = 64


def sample_rows(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_p: Sequence[float],
    generators: Sequence[torch.Generator],
) -> tuple[list[int], list[float]]:
    """One token and its log-prob per row of ``logits`` ``[rows, vocab]`` (float32)."""
    rows = logits.shape[0]
    tokens = [0] * rows
    logprobs = [0.0] * rows
    greedy = [b for b in range(rows) if temperature[b] <= 0]
    sampled = [b for b in range(rows) if temperature[b] > 0]
    if greedy:
        sub = logits[greedy]
        logp = torch.log_softmax(sub, dim=-1)
        picked = torch.argmax(sub, dim=-1)
        _collect(greedy, picked, logp, tokens, logprobs)
    if sampled:
        sub = logits[sampled]
        temps = torch.tensor([temperature[b] for b in sampled], dtype=sub.dtype)[:, None]
        logp = torch.log_softmax(sub / temps, dim=-1)
        probs = logp.exp()
        cut = [i for i, b in enumerate(sampled) if top_p[b] < 1.0]
        if cut:
            probs[cut] = nucleus(
                probs[cut], torch.tensor([top_p[sampled[i]] for i in cut], dtype=probs.dtype)
            )
        noise = exponential_draws([generators[b] for b in sampled], probs.shape[1])
        picked = torch.argmax(probs / noise, dim=-1)
        _collect(sampled, picked, logp, tokens, logprobs)
    return tokens, logprobs


def exponential_draws(generators: Sequence[torch.Generator], n: int) -> torch.Tensor:
    """``[len(generators), n]`` float32 Exp(1) draws, row ``i`` from ``generators[i]``: what
    ``torch.empty(n).exponential_(generator=generators[i])`` gives, and the generator left where
    it leaves it."""
    uniform = torch.empty((len(generators), n), dtype=torch.float64)
    for row, generator in zip(uniform, generators, strict=True):
        torch.rand(n, dtype=torch.float64, generator=generator, out=row)
    return uniform.neg_().log1p_().neg_().float()


def _collect(rows: list[int], picked: torch.Tensor, logp: torch.Tensor, tokens, logprobs) -> None:
    chosen = logp.gather(1, picked[:, None])[:, 0].tolist()
    for b, token, lp in zip(rows, picked.tolist(), chosen, strict=True):
        tokens[b], logprobs[b] = token, lp


def nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``probs`` ``[rows, vocab]`` outside each row's top-p nucleus set to zero (not renormalised):
    a token is kept when the tokens more likely than it hold less than ``top_p`` (so the top token
    always is). The top ``NUCLEUS_CANDIDATES`` tokens hold the whole nucleus whenever they hold
    ``top_p`` (the token after them has at least that before it); rows where they do not are
    sorted in full."""
    k = min(NUCLEUS_CANDIDATES, probs.shape[-1])
    ranked, order = torch.topk(probs, k, dim=-1)
    mass = torch.cumsum(ranked, dim=-1)
    out = torch.zeros_like(probs)
    wide = (mass[:, -1] < top_p + 1e-6).nonzero()[:, 0].tolist() if k < probs.shape[-1] else []
    narrow = [b for b in range(probs.shape[0]) if b not in set(wide)]
    for subset, full in ((narrow, False), (wide, True)):
        if not subset:
            continue
        if full:  # the margin above: rounding
            r, o = torch.sort(probs[subset], dim=-1, descending=True)
            m = torch.cumsum(r, dim=-1)
        else:
            r, o, m = ranked[subset], order[subset], mass[subset]
        kept = torch.where(m - r < top_p[subset, None], r, torch.zeros_like(r))
        out[subset] = torch.zeros_like(probs[subset]).scatter_(1, o, kept)
    return out
