"""The privileged context x*: a prompt's user message rewritten by a teacher-only template.

The teacher template (``proto.runs.PbsdSpec.teacher_template``) takes the user message as
``{question}``, the verified answer as ``{answer}`` and, where it asks for them, the question's
supporting facts as ``{support}`` (joined by "; "). Everything else in the prompt (the system
message, the markup, the assistant's opening) is kept id for id, so a completion scored after
x* is the same token sequence as after x.

The scorer builds x* here for its teacher pass, and ``pbsd sft`` builds the same x* for
conversations it learns in the teacher's format: both must give the same ids, or the teacher
would score a prompt it was never trained on.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from agent.chat import ChatTokenizer
from proto.templates import template_fields

__all__ = ["fill_template", "hop_entities", "teacher_prompt_ids"]

# worldgen.support: "<hop> is <entity> (page <url>)"; the hop may say "is" too ("where X is based")
_FACT = re.compile(r"^.* is (.+) \(page [^)]*\)$")


def hop_entities(support: Sequence[str], answer: str) -> set[str]:
    """The hops of a question: the entities its supporting facts state (a fact not in the world's
    wording is skipped), its answer left out."""
    return {m.group(1) for fact in support if (m := _FACT.search(fact))} - {answer}


def fill_template(template: str, question: str, answer: str, support: Sequence[str] = ()) -> str:
    """The template with its fields filled; ``{support}`` needs at least one fact."""
    if "support" in template_fields(template) and not support:
        raise ValueError("the teacher template asks for {support}, but the question has no supporting facts")
    return template.format(question=question, answer=answer, support="; ".join(support))


def teacher_prompt_ids(
    tokenizer: ChatTokenizer,
    prompt_ids: list[int],
    answer: str,
    template: str,
    support: Sequence[str] = (),
) -> list[int]:
    """The student prompt with its (last) user message rewritten by the teacher template."""
    start_id = tokenizer.encode(tokenizer.fmt.start)[0]
    end_id = tokenizer.end_id
    starts = [i for i, t in enumerate(prompt_ids) if t == start_id]
    if len(starts) < 2:
        raise ValueError("the prompt has no user message before the assistant's opening")
    # the last <|im_start|> opens the assistant turn; the one before, the user message
    user_start = starts[-2]
    try:
        user_end = prompt_ids.index(end_id, user_start)
    except ValueError:
        raise ValueError("the user message is not closed") from None
    segment = tokenizer.decode(prompt_ids[user_start + 1 : user_end])
    role, sep, content = segment.partition("\n")
    if role != "user" or not sep:
        raise ValueError(f"expected a user message before the assistant turn, found role {role!r}")
    # as the student's prompt was encoded: markup, then the content as text, so a question or an
    # answer that spells a special token ("<|im_end|>") cannot open a turn in x* that x lacks
    filled = fill_template(template, content, answer, support)
    rewritten = tokenizer.encode(f"{role}\n") + tokenizer.encode_text(filled)
    return prompt_ids[: user_start + 1] + rewritten + prompt_ids[user_end:]
