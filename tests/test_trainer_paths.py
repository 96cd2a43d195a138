"""The trainer's API and a run's paths where mutation testing found them untested: a record that
names the runs folder itself, the bearer scheme's case, a declared length one byte over the cap,
roots matched by prefix, every path field of a spec held to its roots, data roots taken for model
roots, a hub id that names a local folder, and DeepSpeed path keys in lists or named "..".
"""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import TOKEN

AUTH = {"Authorization": f"Bearer {TOKEN}"}


# ---------------------------------------------------------------- trainer/api.py ----------------
# a record whose output folder is the runs folder itself: refused, not the whole folder removed
async def test_deleting_files_never_removes_the_runs_folder_itself(
    api, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    import redis.asyncio as aioredis

    from services.trainer.runs import RunStore
    from tests.test_trainer_api import _parked_run
    from tests.test_trainer_service import _spec

    runs = tmp_path / "runs"
    other = await _parked_run(redis_url, key_prefix, _spec(tiny_world, tiny_checkpoint), "completed")
    (runs / other / "checkpoints").mkdir(parents=True)
    odd = await _parked_run(redis_url, key_prefix, _spec(tiny_world, tiny_checkpoint), "failed")
    client = aioredis.Redis.from_url(redis_url)
    try:
        await RunStore(client, key_prefix).update(odd, output_dir=str(runs))
    finally:
        await client.aclose()
    async with httpx.AsyncClient(base_url=api, headers=AUTH) as http:
        r = await http.delete(f"/runs/{odd}", params={"files": True})
    assert r.status_code == 409, r.text
    assert (runs / other / "checkpoints").is_dir()


# the scheme is case-insensitive (RFC 7235)
async def test_the_bearer_scheme_is_matched_in_any_case(api):
    async with httpx.AsyncClient(base_url=api) as http:
        assert (await http.get("/runs", headers={"Authorization": f"bearer {TOKEN}"})).status_code == 200


# one byte over is refused unread
def test_a_declared_length_one_byte_over_the_cap_is_refused_unread(api):
    from tests.test_trainer_hardening import _post_head, _raw

    answer = _raw(api, _post_head("/runs", 2**20 + 1, token=True), b"{", timeout=3)
    assert answer.startswith("HTTP/1.1 413"), answer[:200]


# ---------------------------------------------------------------- trainer/spec_paths.py ---------
def _settings(tmp_path, **kw):
    from services.trainer.settings import TrainerSettings

    data, models = tmp_path / "data", tmp_path / "models"
    data.mkdir(exist_ok=True)
    models.mkdir(exist_ok=True)
    return TrainerSettings(
        local_mode=True, runs_dir=tmp_path / "runs", data_roots=[data], model_roots=[models], **kw
    )


def _run_spec(tmp_path, **overrides):
    from proto.runs import RunSpec

    (tmp_path / "data" / "q.jsonl").write_text("{}\n")
    (tmp_path / "models" / "m").mkdir(parents=True, exist_ok=True)
    spec = {
        "model": {"path": str(tmp_path / "models" / "m")},
        "data": {"train": str(tmp_path / "data" / "q.jsonl")},
        "algorithm": {"name": "grpo"},
    }
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        spec[section][key] = value
    return RunSpec.model_validate(spec)


# /x/data-evil passed as under /x/data
def test_a_sibling_folder_sharing_a_roots_name_prefix_is_not_under_it(tmp_path):
    from services.trainer.spec_paths import SpecPathError, resolve_spec_paths

    settings = _settings(tmp_path)
    evil = tmp_path / "data-evil"
    evil.mkdir()
    (evil / "q.jsonl").write_text("{}\n")
    with pytest.raises(SpecPathError, match="not under the trainer's data roots") as err:
        resolve_spec_paths(_run_spec(tmp_path, data__train=str(evil / "q.jsonl")), settings)
    assert err.value.loc == ["data", "train"]


# validation and tokenizer held to the roots
@pytest.mark.parametrize(
    ("field", "loc"),
    [("data__validation", ["data", "validation"]), ("model__tokenizer", ["model", "tokenizer"])],
)
def test_every_path_of_a_spec_is_held_to_its_roots(tmp_path, field, loc):
    from services.trainer.spec_paths import SpecPathError, resolve_spec_paths

    settings = _settings(tmp_path)
    outside = tmp_path / "elsewhere"
    (outside / "tok").mkdir(parents=True)
    (outside / "v.jsonl").write_text("{}\n")
    value = str(outside / ("v.jsonl" if field.startswith("data") else "tok"))
    with pytest.raises(SpecPathError, match="is not under the trainer's") as err:
        resolve_spec_paths(_run_spec(tmp_path, **{field: value}), settings)
    assert err.value.loc == loc


def test_a_checkpoint_under_a_data_root_only_is_refused(tmp_path):
    from services.trainer.spec_paths import SpecPathError, resolve_spec_paths

    settings = _settings(tmp_path)
    (tmp_path / "data" / "ckpt").mkdir()
    with pytest.raises(SpecPathError, match="model roots"):
        resolve_spec_paths(_run_spec(tmp_path, model__path=str(tmp_path / "data" / "ckpt")), settings)


# the
# trainer's loader would read the local folder, outside every root
def test_a_hub_id_that_names_a_local_folder_outside_the_roots_is_refused(tmp_path, monkeypatch):
    from services.trainer.spec_paths import SpecPathError, resolve_spec_paths

    settings = _settings(tmp_path, hub_models=True)
    (tmp_path / "secret" / "weights").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecPathError, match="model roots"):
        resolve_spec_paths(_run_spec(tmp_path, model__path="secret/weights"), settings)
    assert (
        resolve_spec_paths(_run_spec(tmp_path, model__path="Org/Model"), settings).model.path == "Org/Model"
    )


# ---------------------------------------------------------------- trainer/deepspeed_config.py ---
# ".." alone is a path, and paths inside lists are found
@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"csv_monitor": {"enabled": True, "job_name": ".."}}, "csv_monitor.job_name"),
        ({"monitors": [{"output_path": "/data/models"}]}, "monitors[0].output_path"),
    ],
)
def test_file_keys_finds_a_bare_dotdot_name_and_paths_inside_lists(config, key):
    from proto.runs import TrainerSpec
    from services.trainer.deepspeed_config import checked_config, file_keys

    assert file_keys(config) == [key]
    with pytest.raises(ValueError, match="names files or folders"):
        checked_config(TrainerSpec(deepspeed_config=config), allow_paths=False)
