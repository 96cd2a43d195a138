"""A run's DeepSpeed config cannot make the trainer write outside its runs folder
(proto/config_files.py): DeepSpeed opens the flops profiler's output_file for writing, and the
monitors, NVMe offload, autotuning and Nebula write under the paths their sections name."""

from __future__ import annotations

import json

import httpx
import pytest

from proto.config_files import file_keys
from proto.runs import TrainerSpec
from tests.test_trainer_hardening import AUTH
from tests.test_trainer_service import _spec

# what DeepSpeed writes to, with the key it names it by
WRITERS = [
    (
        {"flops_profiler": {"enabled": True, "profile_step": 1, "output_file": "latest"}},
        "flops_profiler.output_file",
    ),
    ({"tensorboard": {"enabled": True, "output_path": "/data/runs/other"}}, "tensorboard.output_path"),
    ({"csv_monitor": {"enabled": True, "job_name": "../../../data/models"}}, "csv_monitor.job_name"),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/data"}}},
        "zero_optimization.offload_param.nvme_path",
    ),
    ({"autotuning": {"enabled": True, "results_dir": "r"}}, "autotuning.results_dir"),
    ({"nebula": {"enabled": True, "persistent_storage_path": "/x"}}, "nebula.persistent_storage_path"),
]

USUAL = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 5e8},
    "bf16": {"enabled": True},
    "flops_profiler": {"enabled": True, "profile_step": 2, "output_file": None},  # to the log
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-6, "betas": [0.9, 0.99]}},
    "wandb": {"enabled": False, "project": "pbsd"},
}


@pytest.mark.parametrize(("config", "key"), WRITERS, ids=[k for _, k in WRITERS])
def test_a_config_that_names_a_file_or_folder_is_refused(config, key):
    assert file_keys(config) == [key]
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        TrainerSpec(deepspeed_config=config)


def test_the_usual_configs_name_nothing():
    assert file_keys(USUAL) == [] and TrainerSpec(deepspeed_config=USUAL).deepspeed_config == USUAL


def test_the_api_refuses_such_a_config_inline_and_as_a_file(api, tiny_world, tiny_checkpoint, tmp_path):
    """Inline, as a file under the roots, or a file that was harmless at submission and changed
    before the run opened: DeepSpeed never sees it."""
    from services.trainer.deepspeed_config import deepspeed_config

    spec = _spec(tiny_world, tiny_checkpoint)
    spec["trainer"]["deepspeed_config"] = WRITERS[0][0]
    r = httpx.post(f"{api}/runs", json=spec, headers=AUTH)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "trainer", "deepspeed_config"]
    assert "flops_profiler.output_file" in r.json()["detail"][0]["msg"]

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(WRITERS[1][0]))
    spec["trainer"]["deepspeed_config"] = str(path)
    r = httpx.post(f"{api}/runs", json=spec, headers=AUTH)
    assert r.status_code == 422 and "tensorboard.output_path" in r.json()["detail"][0]["msg"], r.text
    path.write_text("[1, 2]")
    r = httpx.post(f"{api}/runs", json=spec, headers=AUTH)
    assert r.status_code == 422 and "not a JSON object" in r.json()["detail"][0]["msg"]
    assert httpx.get(f"{api}/runs", headers=AUTH).json() == []  # nothing was queued

    path.write_text(json.dumps(USUAL))
    r = httpx.post(f"{api}/runs", json=spec, headers=AUTH)
    assert r.status_code == 201, r.text
    stored = httpx.get(f"{api}/runs/{r.json()['id']}", headers=AUTH).json()["spec"]["trainer"]
    assert httpx.post(f"{api}/runs/{r.json()['id']}/cancel", headers=AUTH).status_code == 202
    path.write_text(json.dumps({**USUAL, **WRITERS[2][0]}))  # changed after the submission
    with pytest.raises(ValueError, match=r"csv_monitor\.job_name"):
        deepspeed_config(TrainerSpec.model_validate(stored))
