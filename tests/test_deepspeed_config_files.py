"""A run's DeepSpeed config cannot make the trainer write outside its runs folder
(services/trainer/deepspeed_config.py): DeepSpeed opens the flops profiler's output_file for
writing, and the monitors, NVMe offload, autotuning and Nebula write under the paths their
sections name. An operator may let run specs name them (PBSD_TRAINER_DEEPSPEED_PATHS)."""

from __future__ import annotations

import json

import httpx
import pytest

from proto.runs import TrainerSpec
from services.trainer.deepspeed_config import checked_config, file_keys, read_config_file
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
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "nvme_path": None}},
    "bf16": {"enabled": True},
    "flops_profiler": {"enabled": True, "profile_step": 2, "output_file": None},  # to the log
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-6, "betas": [0.9, 0.99]}},
    "tensorboard": {"enabled": False, "output_path": ""},
    "wandb": {"enabled": False, "project": "pbsd", "team": "rl"},
    "csv_monitor": {"enabled": True, "job_name": "seed-0"},  # a name, under the working directory
    "activation_checkpointing": {"profile": True},
}


@pytest.mark.parametrize(("config", "key"), WRITERS, ids=[k for _, k in WRITERS])
def test_a_config_that_names_a_file_or_folder_is_refused_unless_allowed(config, key):
    assert file_keys(config) == [key]
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        checked_config(TrainerSpec(deepspeed_config=config), allow_paths=False)
    assert checked_config(TrainerSpec(deepspeed_config=config), allow_paths=True).deepspeed_config == config


def test_the_usual_configs_name_nothing():
    assert file_keys(USUAL) == []
    assert checked_config(TrainerSpec(deepspeed_config=USUAL), allow_paths=False).deepspeed_config == USUAL


def test_a_config_file_is_held_to_the_inline_rules(tmp_path):
    path = tmp_path / "ds.json"
    for text, why in (
        ("[1, 2]", "not a JSON object"),
        ("[" * 100_000, "not a readable JSON file"),  # a RecursionError was a 500 at submission
        ('{"a": NaN}', "finite"),
        ("\xff\xfe", "not a readable JSON file"),
    ):
        path.write_text(text, encoding="latin-1")
        with pytest.raises(ValueError, match=why):
            read_config_file(path)
    path.write_text(" " * (1 << 20) + "{}")
    with pytest.raises(ValueError, match="larger than"):
        read_config_file(path)
    path.write_text(json.dumps(USUAL))
    spec = checked_config(TrainerSpec(deepspeed_config=str(path)), allow_paths=False)
    assert spec.deepspeed_config == USUAL  # inline from now on: every rank trains with what was checked


def test_the_api_refuses_such_a_config_inline_and_as_a_file(api, tiny_world, tiny_checkpoint, tmp_path):
    """Inline, as a file under the roots, or a file that was harmless at submission and changed
    before the run opened: DeepSpeed never sees it."""
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
    path.write_text("[" * 100_000)
    r = httpx.post(f"{api}/runs", json=spec, headers=AUTH)
    assert r.status_code == 422 and "not a readable JSON file" in r.json()["detail"][0]["msg"]
    assert httpx.get(f"{api}/runs", headers=AUTH).json() == []  # nothing was queued

    path.write_text(json.dumps(USUAL))
    r = httpx.post(f"{api}/runs", json=spec, headers=AUTH)
    assert r.status_code == 201, r.text
    stored = httpx.get(f"{api}/runs/{r.json()['id']}", headers=AUTH).json()["spec"]["trainer"]
    assert httpx.post(f"{api}/runs/{r.json()['id']}/cancel", headers=AUTH).status_code == 202
    path.write_text(json.dumps({**USUAL, **WRITERS[2][0]}))  # changed after the submission
    with pytest.raises(ValueError, match=r"csv_monitor\.job_name"):
        checked_config(TrainerSpec.model_validate(stored), allow_paths=False)
