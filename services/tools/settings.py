"""Settings of the tool gateway: ``PBSD_TOOLS_*`` (plus the shared ``REDIS_URL``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from agent.toolcall import DEFAULT_MAX_RESULT_CHARS
from services.settings import CommonSettings
from worldgen.formats import load_corpus

# Jina's rate-limit page (jina.ai/api-dashboard/rate-limit, read 2026-11-28): the Reader takes 500
# requests a minute with a free or paid key and 20 without; these stay just under
JINA_RATE_KEYED = 8.0
JINA_RATE_KEYLESS = 0.3

# the version of what the tools answer for the same arguments and settings: a change of the code that
# changes an answer (a read refused that was served) bumps it, so the cache stops serving the old ones
ANSWERS_FORMAT = 3  # 3: benchmark links matched in canonical form, a read's passages cut


class ToolsSettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="PBSD_TOOLS_", extra="ignore")

    backend: Literal["offline", "web"] = "offline"
    corpus: Path | None = Field(
        default=None, description="offline backend: JSONL corpus (e.g. the world's corpus.jsonl)"
    )
    host: str = "127.0.0.1"
    port: int = 8001
    use_redis: bool = Field(
        default=True, description="cache and budgets in Redis (shared by replicas); else in process"
    )

    max_body_bytes: int = Field(
        default=262_144, ge=1024, description="a /call body past this size is refused (413) unread"
    )
    cpu_workers: int = Field(
        default=1,
        ge=1,
        description="threads for CPU-bound work (search, HTML to text, extraction); the event loop keeps "
        "the rest of a core for sockets and cache hits",
    )
    cpu_nice: int = Field(
        default=5,
        ge=0,
        le=19,
        description="how much lower the CPU threads' OS priority is than the event loop's",
    )
    near_cache_items: int = Field(default=10_000, ge=0, description="cache entries kept in the process")
    near_cache_mb: int = Field(
        default=256, ge=0, description="the most the cache entries kept in the process may hold, in MiB"
    )
    cache_redis_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="cache entries are written to Redis only while it holds less than this share of its "
        "maxmemory (none set: always): the bus shares it and runs without eviction",
    )
    near_cache_ttl_s: float = Field(
        default=600.0, ge=0, description="how long a near copy may answer without asking Redis"
    )
    search_ttl_s: int = 86_400
    read_ttl_s: int = 7 * 86_400
    max_result_chars: int = DEFAULT_MAX_RESULT_CHARS
    call_deadline_s: float = Field(
        default=240.0,
        gt=0,
        description="one tool call's limit, retries and fallbacks included; keep it under the rollout "
        "client's 300 s so a slow read is a failed call, not a failed trajectory",
    )
    keep_alive_s: int = Field(
        default=75,
        ge=1,
        description="how long the gateway keeps an idle HTTP connection open: longer than its clients "
        "keep one (30 s), so that a client never sends on a connection the gateway is closing",
    )
    call_budget: int = Field(
        default=300, description="tool calls one trajectory may make (the paper's turn limit)"
    )

    serper_url: str = "https://google.serper.dev"
    serper_api_key: SecretStr | None = None
    serper_concurrency: int = 32
    serper_rate_per_s: float | None = 50.0
    serper_max_num: int = Field(
        default=10,
        ge=1,
        le=100,
        description="results asked of Serper a search at most, whatever num the agent asks for: more "
        "than 10 is billed 2 credits a query (Serper's pricing as others report it; each reply's "
        "`credits` is counted in pbsd_tools_serper_credits_total), and Google has served at most "
        "10 a page since late 2025",
    )
    jina_url: str = "https://r.jina.ai"
    jina_api_key: SecretStr | None = None
    use_jina: bool = True
    jina_concurrency: int = 32
    jina_rate_per_s: float | None = Field(
        default=None,
        description="Jina Reader requests a second; unset: under Jina's published limit for the key "
        "(500 a minute with a key, 20 without)",
    )
    summariser_base_url: str | None = Field(
        default=None, description="OpenAI-compatible /v1 URL; extractive if unset"
    )
    summariser_model: str = "gpt-oss-120b"
    summariser_api_key: SecretStr | None = None
    summariser_concurrency: int = Field(default=32, ge=1, description="summaries in flight at once")
    summariser_max_content_chars: int = 120_000
    summariser_temperature: float = 0.0
    summariser_omit_temperature: bool = Field(
        default=False,
        description="send no temperature (OpenAI's reasoning models refuse any but their default)",
    )
    fetch_max_bytes: int = 5_000_000
    fetch_timeout_s: float = 20.0
    resolver_threads: int = Field(
        default=16,
        ge=1,
        description="host lookups in flight at once, in threads of their own (a slow resolver holds "
        "its thread past the read's timeout); a read that finds them all waiting fails at once",
    )
    upstream_timeout_s: float = 60.0
    allow_hosts: list[str] = Field(
        default_factory=list, description="host:port pairs exempt from the SSRF address rules"
    )
    blocked_result_hosts: list[str] = Field(
        default_factory=lambda: ["huggingface.co/datasets", "huggingface.co/spaces", "browsecomp"],
        description="links containing one of these (benchmark leaks) are dropped from search results "
        "and refused as pages to read",
    )

    @field_validator("corpus")
    @classmethod
    def _corpus_is_a_file(cls, value: Path | None) -> Path | None:
        """A file with a usable document, read to the first one: a corpus that has none is said in
        a line at start, not in the loader's traceback under "Application startup failed"."""
        if value is not None and not value.is_file():
            raise ValueError(f"{value} is not a file")
        if value is not None:
            load_corpus(value, limit=1).raise_if_empty(value, warn=False)  # the app's read warns
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if "jina_rate_per_s" not in self.model_fields_set:  # an explicit None still means no limit
            self.jina_rate_per_s = JINA_RATE_KEYED if self.jina_api_key else JINA_RATE_KEYLESS
        if self.backend == "web" and self.serper_api_key is None:
            raise ValueError("the web backend needs PBSD_TOOLS_SERPER_API_KEY")
        if self.backend == "offline" and self.corpus is None:
            raise ValueError("the offline backend needs PBSD_TOOLS_CORPUS (a JSONL of {url, title, text})")
        return self

    def secrets(self) -> list[str]:
        return [
            s.get_secret_value()
            for s in (self.serper_api_key, self.jina_api_key, self.summariser_api_key)
            if s
        ]

    def answers_tag(self) -> str:
        """A short hash of what shapes a tool's answer besides its arguments: the code's answer format
        (``ANSWERS_FORMAT``), the backend, its corpus (its content), where answers are cut, the hosts that are dropped from
        results and never read, the reader and the summariser. The cache keys carry it, so an answer cached before a change
        of these (a host added to the blocked list, a corpus rebuilt) is not served after it."""
        shaping = self.model_dump(
            mode="json",
            include={
                "backend",
                "max_result_chars",
                "blocked_result_hosts",
                "allow_hosts",
                "fetch_max_bytes",
                *(() if self.backend == "offline" else ("use_jina", "jina_url")),
                *(
                    (
                        "summariser_base_url",
                        "summariser_model",
                        "summariser_max_content_chars",
                        "summariser_temperature",
                        "summariser_omit_temperature",
                    )
                    if self.summariser_base_url
                    else ()
                ),
            },
        )
        shaping["format"] = ANSWERS_FORMAT
        if self.backend == "offline" and self.corpus is not None:
            digest = hashlib.sha256()
            with Path(self.corpus).open("rb") as f:  # its content: replicas' copies agree wherever they lie
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
            shaping["corpus"] = digest.hexdigest()
        return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:12]
