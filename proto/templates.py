"""The teacher's privileged context x*: the templates that rewrite the question's user message
with the verified answer (and, beyond the paper, the question's supporting facts), by the names
the run spec and the command line know them by. ``proto.runs.PbsdSpec.teacher_template`` takes
one; ``agent.privileged`` fills it."""

from __future__ import annotations

import string

__all__ = [
    "ANSWER_FIRST_TEACHER_TEMPLATE",
    "DEFAULT_TEACHER_TEMPLATE",
    "SUPPORT_FIRST_TEACHER_TEMPLATE",
    "SUPPORT_TEACHER_TEMPLATE",
    "TEACHER_TEMPLATES",
    "TEMPLATE_FIELDS",
    "template_fields",
]

# The privileged context x*: the question with the verified answer, said plainly to be
# known and for evaluation only. {question} and {answer} are filled in by the scorer.
DEFAULT_TEACHER_TEMPLATE = (
    "{question}\n\n"
    "[Evaluation note, not part of the task: the verified correct answer to this question is "
    '"{answer}". It is given only so that this conversation can be evaluated; '
    "the assistant below did not see it.]"
)
# Beyond the paper: the same note with the question's supporting facts (QuestionRecord.support:
# the chain of facts the answer rests on, each with the page that states it), so that the
# teacher can favour the searches and reads that follow the chain, not only the final answer.
SUPPORT_TEACHER_TEMPLATE = (
    "{question}\n\n"
    "[Evaluation note, not part of the task: the verified correct answer to this question is "
    '"{answer}". It rests on these facts: {support}. They are given only so that this '
    "conversation can be evaluated; the assistant below did not see them.]"
)
TEMPLATE_FIELDS = ("question", "answer", "support")  # {support}: the facts joined by "; "
# The same answer-only teacher with the note before the question, in a few words: a model reads the
# end of the user message most, so x* then differs from x least where the policy looks.
ANSWER_FIRST_TEACHER_TEMPLATE = "Verified answer: {answer}\n\n{question}"
# Beyond the paper: the answer-first note with the supporting facts on a second line, so the lab's
# tiny teacher finds the hops in the same short note it learns to read the answer from.
SUPPORT_FIRST_TEACHER_TEMPLATE = "Verified answer: {answer}\nFacts: {support}\n\n{question}"
# the templates by the names the command line knows them by
TEACHER_TEMPLATES = {
    "answer": DEFAULT_TEACHER_TEMPLATE,
    "support": SUPPORT_TEACHER_TEMPLATE,
    "answer-first": ANSWER_FIRST_TEACHER_TEMPLATE,
    "support-first": SUPPORT_FIRST_TEACHER_TEMPLATE,
}


def template_fields(template: str) -> set[str]:
    """The fields a teacher template fills: parsed, not searched, so "{{support}}" is text."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
