"""An LLM judge in BrowseComp's grading style, through any OpenAI-compatible endpoint.

The prompt is BrowseComp's grader template (openai/simple-evals, browsecomp_eval.py);
the verdict is read from its ``correct: yes|no`` line, and a reply without that line
counts as incorrect, as in the reference grader. Use it where the rule-based
verifier is too strict (free-form answers); the generated world's answers are
checked exactly and do not need it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.llm.client import ChatClient, LlmSettings

__all__ = ["GRADER_TEMPLATE", "JudgeSettings", "JudgeVerdict", "LlmJudge"]

GRADER_TEMPLATE = """
Judge whether the following [response] to [question] is correct or not based on the precise and unambiguous [correct_answer] below.

[question]: {question}

[response]: {response}

Your judgement must be in the format and criteria specified below:

extracted_final_answer: The final exact answer extracted from the [response]. Put the extracted answer as 'None' if there is no exact, final answer to extract from the response.

[correct_answer]: {correct_answer}

reasoning: Explain why the extracted_final_answer is correct or incorrect based on [correct_answer], focusing only on if there are meaningful differences between [correct_answer] and the extracted_final_answer. Do not comment on any background to the problem, do not attempt to solve the problem, do not argue for any answer different than [correct_answer], focus only on whether the answers match.

correct: Answer 'yes' if extracted_final_answer matches the [correct_answer] given above, or is within a small margin of error for numerical problems. Answer 'no' otherwise, i.e. if there if there is any inconsistency, ambiguity, non-equivalency, or if the extracted answer is incorrect.


confidence: The extracted confidence score between 0|\\%| and 100|\\%| from [response]. Put 100 if there is no confidence score available.
""".strip()

_CORRECT = re.compile(r"correct:\s*(yes|no)", re.IGNORECASE)
_EXTRACTED = re.compile(r"extracted_final_answer:\s*(.+)")


class JudgeSettings(BaseSettings):
    """``PBSD_JUDGE_BASE_URL``, ``PBSD_JUDGE_MODEL``, ``PBSD_JUDGE_API_KEY``."""

    model_config = SettingsConfigDict(env_prefix="PBSD_JUDGE_", extra="ignore", env_ignore_empty=True)

    base_url: str | None = None
    model: str = "gpt-4.1-2025-04-14"
    api_key: SecretStr | None = None
    timeout_s: float = 120.0

    @property
    def enabled(self) -> bool:
        return bool(self.base_url)

    def llm(self) -> LlmSettings:
        if not self.base_url:
            raise ValueError("the LLM judge needs PBSD_JUDGE_BASE_URL")
        return LlmSettings(
            base_url=self.base_url, model=self.model, api_key=self.api_key, timeout_s=self.timeout_s
        )


@dataclass(frozen=True)
class JudgeVerdict:
    correct: bool
    extracted: str | None
    raw: str


class LlmJudge:
    def __init__(self, client: ChatClient) -> None:
        self.client = client

    @classmethod
    def from_settings(cls, settings: JudgeSettings) -> LlmJudge:
        return cls(ChatClient(settings.llm(), name="judge"))

    async def judge(self, question: str, response: str, correct_answer: str) -> JudgeVerdict:
        prompt = GRADER_TEMPLATE.format(question=question, response=response, correct_answer=correct_answer)
        result = await self.client.complete([{"role": "user", "content": prompt}], temperature=0.0)
        return parse_verdict(result.text)

    async def aclose(self) -> None:
        await self.client.aclose()


def parse_verdict(text: str) -> JudgeVerdict:
    m = _CORRECT.search(text)
    e = _EXTRACTED.search(text)
    extracted = e.group(1).strip() if e else None
    if extracted in ("None", ""):
        extracted = None
    return JudgeVerdict(correct=bool(m) and m.group(1).lower() == "yes", extracted=extracted, raw=text)
