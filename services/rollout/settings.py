"""Settings of a rollout worker: ``PBSD_ROLLOUT_*`` (plus the shared ``REDIS_URL``)."""

from __future__ import annotations

import socket
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.settings import WorkerSettings


class RolloutSettings(WorkerSettings):
    model_config = SettingsConfigDict(env_prefix="PBSD_ROLLOUT_", extra="ignore")

    engine: Literal["inprocess", "sglang"] = "inprocess"
    model: str = Field(description="initial policy checkpoint (HF directory with the tokenizer)")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    sglang_urls: list[str] = Field(default_factory=list, description="SGLang servers, load-balanced")
    tools_url: str = "http://127.0.0.1:8001"
    concurrency: int = Field(default=2, ge=1, description="prompts (groups) worked on at once by this worker")
    worker_name: str = Field(
        default_factory=lambda: f"rollout-{socket.gethostname()}",
        description="consumer name in the stream group; must differ between replicas (default: from the host name)",
    )
    date: str | None = Field(
        default=None, description="'today' in the system prompt (YYYY-MM-DD); default: today"
    )
    seed: int | None = Field(
        default=None,
        description=(
            "fixed sampling seeds (tests, reproductions); random when unset. SGLang honours them "
            "only when started with --enable-deterministic-inference"
        ),
    )
    keep_every_s: float = Field(
        default=30.0,
        ge=0,
        description="how often each group being sampled is kept in Redis (when it has grown: KEEP_GROWTH), so that the worker taking over "
        "from one killed outright (out of memory, its node lost) goes on from there; 0: kept only as "
        "the worker leaves on SIGTERM",
    )
    keep_growth: float = Field(
        default=0.25,
        ge=0,
        description="a group is kept again as it samples only once it has grown by this fraction of its "
        "tokens since its last keep: the keeps then write at most 1 + 1/growth times the group's size "
        "however long it samples, and a worker killed outright loses less than this fraction of it "
        "(plus a round)",
    )
    accept_broadcast: bool = Field(
        default=False,
        description="take policy versions the trainer broadcasts (SGLang's weight-update endpoints on "
        "this service's port; list its URL in PBSD_TRAINER_WEIGHTS_RECEIVERS): engine inprocess only",
    )
    host: str = "127.0.0.1"
    port: int = 8002

    @model_validator(mode="after")
    def _consistent(self):
        if self.accept_broadcast and self.engine != "inprocess":
            raise ValueError(
                "accept_broadcast needs the inprocess engine: SGLang servers take broadcasts themselves"
            )
        if self.engine == "sglang" and not self.sglang_urls:
            raise ValueError("the sglang engine needs PBSD_ROLLOUT_SGLANG_URLS")
        return self
