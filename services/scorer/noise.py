"""The evidence's noise floor: a null pass, in which the true evidence is 0.

Student and teacher contexts differ in length (x* adds the answer note), so the kernels that
score them tile, pad or pack them differently, and in bfloat16 the same token gets a slightly
different log-prob on each path; that difference enters every s. To measure it, a sample of the
group's trajectories (``PbsdSpec.noise_floor_samples``) has its student context scored a second
time, laid out as the teacher context is::

    null context = student + teacher[len(student):]     (the teacher's length; the tail is the
                                                         completion's last tokens)
                 = student[:len(teacher)]               (x* cut at a teacher_max_length)
    d_k          = log p_null(z_k) - log p_student(z_k)   for the loss tokens inside it

Attention is causal, so tokens appended after the student context cannot change what any student
position computes: every d_k is 0 in exact arithmetic, and what is left is the rounding of the
layout difference. The null requests go to the same likelihood function, in the same call and
with the same batching procedure as the group's student and teacher requests:

- local backend, one sequence at a time (``pack=False``, the CPU default): the null is a
  sequence of the teacher's length run alone, as the teacher is: the same matrix and attention
  shapes, so exactly the student/teacher shape difference;
- local backend, packed: first-fit packing places the null by its length, as it places the
  teacher; it gets neighbours and an offset of its own, a difference of the same kind as the
  teacher's, not the teacher's very batch;
- SGLang: one more ``/generate`` request, batched by the server with whatever runs beside it,
  as the teacher request is.

What it cannot see: the teacher's completion sits ``shift`` positions later than the student's,
so its rotary angles differ; the null keeps the student's positions (neither backend takes a
position offset). Rotary attention depends on relative positions only, so that difference is 0 in
exact arithmetic too, but its rounding is not measured: the measured floor is a lower bound.
"""

from __future__ import annotations

import numpy as np

from proto.runs import PbsdSpec
from proto.sanity import NoiseFloor
from services.scorer.contexts import Contexts

__all__ = ["null_floor", "null_picks", "null_request"]


def null_picks(scored: list[int], samples: int) -> list[int]:
    """``samples`` of the ``scored`` trajectory indices, evenly spread (all of them if fewer)."""
    if samples <= 0 or not scored:
        return []
    if samples >= len(scored):
        return list(scored)
    return [scored[int(j * len(scored) / samples)] for j in range(samples)]


def null_request(c: Contexts) -> tuple[list[int], np.ndarray]:
    """The student's tokens in a context of the teacher's length, and the loss positions inside it."""
    length = len(c.teacher)
    ids = (c.student + c.teacher[len(c.student) :])[:length]
    return ids, c.loss_positions[c.loss_positions < length]


def null_floor(student: np.ndarray, null: np.ndarray, c: Contexts, spec: PbsdSpec) -> NoiseFloor:
    """The null pass of one context (``null`` covers the first loss tokens, those inside it)."""
    n = null.size
    return NoiseFloor.of(
        null.astype(np.float64) - student[:n].astype(np.float64),
        c.token_turns[:n],
        eps_pos=spec.eps_pos,
        eps_neg=spec.eps_neg,
    )
