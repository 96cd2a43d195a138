"""Settings of the trainer: ``PBSD_TRAINER_*`` (plus the shared ``REDIS_URL``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from services.settings import ConsumerSettings


class TrainerSettings(ConsumerSettings):
    model_config = SettingsConfigDict(env_prefix="PBSD_TRAINER_", extra="ignore")

    api_token: SecretStr | None = Field(default=None, description="bearer token for the REST API")
    local_mode: bool = Field(
        default=False,
        description="allow running without an API token; `pbsd serve trainer` then binds to loopback only",
    )
    host: str = "127.0.0.1"
    port: int = 8000
    runs_dir: Path = Path("runs")
    data_roots: list[Path] = Field(
        default_factory=lambda: [Path(".")],
        min_length=1,
        description="folders a run's question files may lie in (JSON list; default: the working "
        "directory); a spec naming a path outside them is refused",
    )
    model_roots: list[Path] = Field(
        default_factory=lambda: [Path(".")],
        min_length=1,
        description="folders a run's checkpoint, tokenizer and DeepSpeed config may lie in, beside "
        "runs_dir (JSON list; default: the working directory)",
    )
    max_body_bytes: int = Field(
        default=1 << 20, gt=0, description="request bodies over this are refused (413) before they are read"
    )
    device: str = "cpu"
    gradient_checkpointing: bool = False
    chunk_size: int = Field(default=1024, description="rows of full-vocabulary logits alive at once")
    keep_weights: int = Field(default=3, ge=1, description="published weight versions kept on disk")
    weights_transport: Literal["disk", "broadcast"] = Field(
        default="disk",
        description="how each policy version reaches the consumers: written to disk and reloaded, or "
        "broadcast over a torch.distributed group to weights_receivers (docs/weights.md); disk "
        "stays in use whenever no group can form",
    )
    weights_receivers: list[str] = Field(
        default_factory=list,
        description="base URLs that take broadcast versions by SGLang's distributed weight update: "
        "SGLang servers, and scorers or rollout workers with PBSD_*_ACCEPT_BROADCAST",
    )
    weights_master_address: str | None = Field(
        default=None,
        description="the address the receivers reach this trainer at for the group's rendezvous "
        "(default: this host's address)",
    )
    weights_master_port: int = Field(default=0, ge=0, description="rendezvous port (0: a free one each time)")
    weights_backend: Literal["nccl", "gloo"] | None = Field(
        default=None, description="default: nccl when the trainer is on CUDA, else gloo"
    )
    weights_bucket_mb: int = Field(default=512, gt=0, description="MiB of tensors per update request")
    weights_timeout_s: float = Field(
        default=300.0, gt=0, description="how long a group formation or one bucket may take"
    )
    weights_catch_up_s: float = Field(
        default=15.0,
        gt=0,
        description="with broadcast: how often a run waiting for groups asks the receivers which "
        "version they serve; one that lost the last broadcast (it restarted since) gets it on disk",
    )
    hub_models: bool = Field(
        default=False, description="accept model paths that are hub ids, not local directories"
    )
    lag_interval_s: float = Field(
        default=5.0, gt=0, description="how often the stream lag gauges are sampled"
    )
    save_groups: bool = Field(
        default=False, description="keep every step's scored groups (reports, the credit viewer)"
    )
    deepspeed_paths: bool = Field(
        default=False,
        description="let a run's DeepSpeed config name files and folders (NVMe offload's nvme_path, a "
        "profiler's or monitor's output): every holder of the API token may then have the trainer "
        "write wherever it can",
    )
    shutdown_grace_s: float = Field(
        default=540.0,
        gt=0,
        description="on SIGTERM, how long the run in progress may take to finish its step and "
        "checkpoint before it is cut off (keep it under the orchestrator's grace period)",
    )

    @model_validator(mode="after")
    def _receivers(self):
        if self.weights_transport == "broadcast" and not self.weights_receivers:
            raise ValueError("weights_transport broadcast needs PBSD_TRAINER_WEIGHTS_RECEIVERS")
        return self

    @model_validator(mode="after")
    def _auth(self):
        if self.api_token is None and not self.local_mode:
            raise ValueError(
                "set PBSD_TRAINER_API_TOKEN, or PBSD_TRAINER_LOCAL_MODE=1 for an unauthenticated local API"
            )
        return self
