"""Settings of the evidence scorer: ``PBSD_SCORER_*`` (plus the shared ``REDIS_URL``)."""

from __future__ import annotations

import socket
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.settings import WorkerSettings


class ScorerSettings(WorkerSettings):
    model_config = SettingsConfigDict(env_prefix="PBSD_SCORER_", extra="ignore")

    backend: Literal["local", "sglang"] = "local"
    model: str = Field(description="initial policy checkpoint (HF directory with the tokenizer)")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    attn_implementation: str | None = Field(
        default=None,
        description="default: on CUDA flash_attention_2 when flash-attn is installed, else flex_attention "
        "(both pack sequences); on CPU transformers' default (sdpa)",
    )
    token_budget: int = Field(default=16_384, description="tokens per likelihood batch")
    chunk_size: int = Field(default=1024, description="rows of full-vocabulary logits alive at once")
    pack: bool | None = Field(
        default=None, description="pack sequences in one forward (default: with flex or flash attention)"
    )
    head: Literal["chunked", "fused"] | None = Field(
        default=None,
        description="LM-head reduction: fused (a Triton kernel, CUDA only) or chunked (torch); "
        "default: fused where it can run",
    )
    sglang_urls: list[str] = Field(default_factory=list)
    worker_name: str = Field(
        default_factory=lambda: f"scorer-{socket.gethostname()}",
        description="consumer name in the stream group; must differ between replicas (default: from the host name)",
    )
    concurrency: int = 1
    accept_broadcast: bool = Field(
        default=False,
        description="take policy versions the trainer broadcasts (SGLang's weight-update endpoints on "
        "this service's port; list its URL in PBSD_TRAINER_WEIGHTS_RECEIVERS): backend local only",
    )
    host: str = "127.0.0.1"
    port: int = 8003

    @model_validator(mode="after")
    def _consistent(self):
        if self.accept_broadcast and self.backend != "local":
            raise ValueError(
                "accept_broadcast needs the local backend: SGLang servers take broadcasts themselves"
            )
        if self.backend == "sglang" and not self.sglang_urls:
            raise ValueError("the sglang backend needs PBSD_SCORER_SGLANG_URLS")
        return self
