"""Settings every service shares, read from the same environment variables everywhere.

Each service has its own settings class (``PBSD_<SERVICE>_...``) that extends this
one; the bus connection and the key prefix are common to all of them, so one
``REDIS_URL`` configures a whole deployment.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.bus import MAX_MESSAGE_BYTES, Bus, ConsumerOptions


class CommonSettings(BaseSettings):
    # populate_by_name: code may pass redis_url=... directly; the environment uses the aliases.
    # env_ignore_empty: compose's ${VAR:-} and example secrets set "" for what a deployment leaves
    # out; "" must mean unset (an empty API key is no key: no "Bearer " header, no passed checks)
    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True, env_ignore_empty=True)

    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("REDIS_URL", "PBSD_REDIS_URL"),
        description="redis://[:password@]host:port/db of the bus (credentials included)",
    )
    stream_prefix: str = Field(
        default="pbsd",
        validation_alias=AliasChoices("PBSD_STREAM_PREFIX"),
        description="prefix of every Redis key, so deployments can share a Redis",
    )
    log_level: str = Field(default="INFO", validation_alias=AliasChoices("PBSD_LOG_LEVEL"))
    redis_patience_s: float = Field(
        default=60.0,
        ge=0,
        validation_alias=AliasChoices("PBSD_REDIS_PATIENCE_S"),
        description="how long a Redis command waits out an outage (reconnecting with backoff) before "
        "it fails; the bus's consumers then keep waiting on their own, and a run resumes from its "
        "last checkpoint once Redis is back",
    )

    bus_max_message_bytes: int = Field(
        default=MAX_MESSAGE_BYTES,
        gt=0,
        validation_alias=AliasChoices("PBSD_BUS_MAX_MESSAGE_BYTES"),
        description="the largest message the bus publishes (512 MiB, Redis's default proto-max-bulk-len, "
        "above which Redis drops the connection); a group past it is dead-lettered at once "
        "(reason too_large) and its prompt replaced. Raise it only with proto-max-bulk-len",
    )

    def bus(self) -> Bus:
        """The bus these settings describe, its commands waiting out an outage for the patience."""
        return Bus.from_url(
            self.redis_url,
            prefix=self.stream_prefix,
            patience_s=self.redis_patience_s,
            max_message_bytes=self.bus_max_message_bytes,
        )

    def __repr_args__(self):  # never print credentials embedded in the Redis URL
        for key, value in super().__repr_args__():
            yield key, (_redact_url(value) if key == "redis_url" else value)


class ConsumerSettings(CommonSettings):
    """What every service that consumes from the bus (rollout, scorer, trainer) shares."""

    heartbeat_s: float = Field(
        default=5.0,
        gt=0,
        le=60,
        description="how often a consumer renews the idle time of what it holds on the bus; what a "
        "dead consumer held moves to another (whatever its name) after MISSED_BEATS (10) missed "
        "beats, so within a minute at the default",
    )

    def consumer_options(self, **kwargs: Any) -> ConsumerOptions:
        return ConsumerOptions(heartbeat_ms=round(self.heartbeat_s * 1000), **kwargs)


# the form of a Hugging Face hub id ("org/name" or "name"), which no local path with more parts has
_HUB_ID = re.compile(r"(?:[\w\-.]+/)?[\w\-.]{1,96}")


def is_hub_id(value: str) -> bool:
    """Whether ``value`` has the form of a Hugging Face hub id, not of a path: one or two parts,
    none of them starting with "." (so no ``..``), and no leading ``/`` or ``~``."""
    return bool(_HUB_ID.fullmatch(value)) and not any(part.startswith(".") for part in value.split("/"))


class WorkerSettings(ConsumerSettings):
    """What the bus-consuming workers (scorer, rollout) share beside the common settings."""

    @field_validator("model", check_fields=False)
    @classmethod
    def _model_is_a_checkpoint(cls, value: str) -> str:
        """A checkpoint directory, or a hub id (fetched where the hub can be reached): a path that
        is neither fails here, in one line, not halfway through start-up."""
        path = Path(value)
        if path.is_dir() and not (path / "config.json").is_file():
            raise ValueError(f"{value} is not a checkpoint directory (no config.json in it)")
        if not path.is_dir() and not is_hub_id(value):
            raise ValueError(f"no checkpoint directory {value} (nor is it a hub id like org/name)")
        return value

    shutdown_grace_s: float = Field(
        default=30.0,
        gt=0,
        description="on SIGTERM, how long the messages in hand may take to finish before the worker "
        "is cancelled; what it could not finish is handed back to the other workers at once",
    )


def _redact_url(url: str) -> str:
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
