"""Student and teacher contexts of a trajectory, and the position map phi between them.

The student context is the trajectory exactly as sampled: ``prompt_ids + completion_ids``.

The teacher context x* is the same conversation with the verified answer added to the
question by a teacher-only template. It is built from the same tokens: the system
message and everything after the user message are kept id for id; only the user
message is rewritten (``template.format(question=<the user message>, answer=y*)``, and
``support=`` the question's supporting facts where the template asks for them; see
``agent.privileged``), encoded once, between the same ``<|im_start|>`` and ``<|im_end|>`` tokens. The
trajectory's completion is then appended unchanged, so every completion token k has
its teacher position ``phi(k) = k + len(teacher prompt) - len(student prompt)``.

By default x* is not cut, so every loss token has its phi. A run whose scorer has a shorter
context (an SGLang server's) sets ``teacher_max_length``: x* is cut there, and loss tokens whose
phi falls beyond the cut have no privileged position and are left out of the evidence
(Algorithm 1: I_{j,k} = {i in T_{j,k} : phi(i) exists}).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agent.chat import ChatTokenizer
from agent.privileged import teacher_prompt_ids
from proto.messages import TrajectoryGroup
from proto.runs import PbsdSpec

__all__ = ["Contexts", "build_contexts", "group_contexts"]


@dataclass(frozen=True)
class Contexts:
    student: list[int]  # prompt + completion, as sampled
    teacher: list[int]  # x* prompt + completion, cut at teacher_max_length
    loss_positions: (
        np.ndarray
    )  # positions in ``student`` of every loss token (completion index + prompt length)
    phi: np.ndarray  # teacher position of each loss token, -1 where it has none
    token_turns: np.ndarray  # turn index of each loss token


def build_contexts(
    tokenizer: ChatTokenizer,
    prompt_ids: list[int],
    completion_ids: list[int],
    loss_mask: np.ndarray,
    turn_spans,
    *,
    answer: str,
    template: str,
    teacher_max_length: int | None,
    support: Sequence[str] = (),
) -> Contexts:
    teacher_prompt = teacher_prompt_ids(tokenizer, prompt_ids, answer, template, support)
    shift = len(teacher_prompt) - len(prompt_ids)
    completion_loss = np.flatnonzero(np.asarray(loss_mask) == 1)
    loss_positions = completion_loss + len(prompt_ids)
    phi = loss_positions + shift
    if teacher_max_length is not None:
        phi = np.where(phi < teacher_max_length, phi, -1)
    lengths = [end - start for start, end in turn_spans]
    token_turns = np.repeat(np.arange(len(lengths)), lengths)
    teacher = (teacher_prompt + list(completion_ids))[:teacher_max_length]  # [:None]: all of it
    return Contexts(list(prompt_ids) + list(completion_ids), teacher, loss_positions, phi, token_turns)


def group_contexts(group: TrajectoryGroup, tokenizer: ChatTokenizer) -> list[Contexts | None]:
    """Each trajectory's contexts under the group's PBSD spec; None for one that failed or has no turn
    (it has nothing to score)."""
    spec = group.algorithm
    if not isinstance(spec, PbsdSpec):
        raise TypeError("contexts are built for PBSD groups")
    return [
        None
        if t.finish_reason == "error" or t.num_turns == 0
        else build_contexts(
            tokenizer,
            t.prompt_ids.tolist(),
            t.completion_ids.tolist(),
            t.loss_mask,
            t.turn_spans,
            answer=group.answer,
            template=spec.teacher_template,
            teacher_max_length=spec.teacher_max_length,
            support=group.support,
        )
        for t in group.trajectories
    ]
