"""OpenAI-compatible chat completions: the page summariser's and the answer judge's model."""

from services.llm.client import ChatClient, ChatResult, LlmSettings

__all__ = ["ChatClient", "ChatResult", "LlmSettings"]
