"""A small client for any OpenAI-compatible ``/chat/completions`` endpoint (OpenAI, vLLM,
SGLang, llama.cpp, ...), with retries that honour Retry-After and keys kept out of logs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import SecretStr

from services.upstream import RetryPolicy, UpstreamError, http_client, send_with_retries


@dataclass(frozen=True)
class LlmSettings:
    base_url: str  # e.g. https://api.openai.com/v1 or http://127.0.0.1:30000/v1
    model: str
    api_key: SecretStr | None = None
    timeout_s: float = 120.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __repr__(self) -> str:  # never print the key
        return f"LlmSettings(base_url={self.base_url!r}, model={self.model!r})"


@dataclass(frozen=True)
class ChatResult:
    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None


class ChatClient:
    def __init__(
        self, settings: LlmSettings, *, http: httpx.AsyncClient | None = None, name: str = "llm"
    ) -> None:
        self.settings = settings
        self.name = name
        self._own_http = http is None
        self.http = http or http_client(settings.timeout_s)

    async def aclose(self) -> None:
        if self._own_http:
            await self.http.aclose()

    async def complete(
        self,
        messages: list[dict[str, str]],
        *,
        temperature: float | None = 0.0,
        max_tokens: int | None = None,
        **extra: Any,
    ) -> ChatResult:
        """``temperature`` None sends none (models that take only their default refuse any other).
        A null ``content`` (a reasoning model that said everything in its reasoning) is ""."""
        s = self.settings
        body: dict[str, Any] = {"model": s.model, "messages": messages, **extra}
        if temperature is not None:
            body["temperature"] = temperature
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        headers = {"Content-Type": "application/json"}
        if s.api_key is not None:
            headers["Authorization"] = f"Bearer {s.api_key.get_secret_value()}"
        url = s.base_url.rstrip("/") + "/chat/completions"

        response = await send_with_retries(
            self.name, lambda: self.http.post(url, json=body, headers=headers, timeout=s.timeout_s), s.retry
        )
        if response.status_code >= 400:
            raise UpstreamError(
                self.name,
                f"HTTP {response.status_code}: {_error_message(response)}",
                status=response.status_code,
            )
        try:
            data = response.json()
            choice = data["choices"][0]
            text = choice["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise UpstreamError(self.name, f"malformed chat completion ({type(exc).__name__})") from None
        if text is None:
            text = ""
        if not isinstance(text, str):
            raise UpstreamError(self.name, "malformed chat completion (content is not a string)")
        usage = data.get("usage") or {}
        return ChatResult(
            text, choice.get("finish_reason"), usage.get("prompt_tokens"), usage.get("completion_tokens")
        )


def _error_message(response: httpx.Response) -> str:
    """The upstream's own error message, short; never echoes the request."""
    try:
        err = response.json().get("error")
        if isinstance(err, dict):
            return str(err.get("message", ""))[:300]
        if err:
            return str(err)[:300]
    except ValueError:
        pass
    return response.text[:300]
