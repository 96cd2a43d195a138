"""``pbsd demo --from-scratch`` rebuilds the warm policy itself (oracle data, tokenizer, tiny model,
SFT, the boxed pass, the note pass: the stages of assets/demo-policy/RECIPE.md) and runs the
pipeline on it. Slow: minutes of SFT even at this size."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from worldgen.build import world_fingerprint

# the suite's 300 s cut it short on a busy 2-core box (its subprocess allows an hour)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_from_scratch_rebuild(tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "n_sft": 80,
                "sft_epochs": 1,
                "sft_batch_size": 8,
                "boxed_pass_conversations": 40,
                "note_pass_steps": 3,
                "steps": 1,
                "prompts_per_step": 2,
                "group_size": 2,
                "eval_questions": 1,
                "max_turns": 2,
                "max_tokens_per_turn": 32,
            }
        )
    )
    out = tmp_path / "demo"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pbsd.cli",
            "demo",
            "--from-scratch",
            "--config",
            str(config),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    meta = json.loads((out / "policy-sft" / "pbsd.json").read_text())
    # each stage started from the one before and kept its record: SFT, the boxed pass, the note pass
    first, boxed = meta["sft_before"], meta["sft"]
    assert first["conversations"] > 60 and first["final_loss"] < first["first_loss"]
    assert boxed["conversations"] == 40 and boxed["config"]["limit"] == 40
    assert meta["note_pass"]["steps"] == 3 and meta["note_pass"]["config"]["consistency"] == 1.0
    warm = out / "warm-start"
    sft = [json.loads(line) for line in (warm / "sft.jsonl").read_text().splitlines()]
    assert all("The answer is " + r["answer"] in r["messages"][-1]["content"] for r in sft)  # restated
    later = [json.loads(line) for line in (warm / "sft-boxed.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in later] == [r["answer"] for r in sft]
    assert all("\\boxed{" + r["answer"] + "}" in r["messages"][-1]["content"] for r in later)
    assert not any(
        "The answer is " + r["answer"] in r["messages"][-1]["content"] for r in later
    )  # boxed first
    assert boxed["data_sha256"] != first["data_sha256"]  # the boxed pass learnt from the boxed data
    assert meta["world_sha256"] == world_fingerprint(
        json.loads((out / "world" / "manifest.json").read_text())
    )
    assert (out / "report.html").exists()
