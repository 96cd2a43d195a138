"""``pbsd demo --from-scratch`` rebuilds the warm policy itself (oracle data, tokenizer, tiny model,
SFT, the note pass) and runs the pipeline on it. Slow: minutes of SFT even at this size."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from worldgen.build import world_fingerprint

pytestmark = pytest.mark.slow


def test_from_scratch_rebuild(tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "n_sft": 80,
                "sft_epochs": 1,
                "sft_batch_size": 8,
                "sft_final": "boxed",
                "note_pass_steps": 3,
                "note_pass_consistency": 1.0,
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
    assert meta["sft"]["conversations"] > 60 and meta["sft"]["final_loss"] < meta["sft"]["first_loss"]
    assert meta["note_pass"]["steps"] == 3  # the note pass ran from the SFT's result, and kept its record
    sft = [json.loads(line) for line in (out / "warm-start" / "sft.jsonl").read_text().splitlines()]
    assert all("\\boxed{" + r["answer"] + "}" in r["messages"][-1]["content"] for r in sft)
    assert not any("The answer is " + r["answer"] in r["messages"][-1]["content"] for r in sft)  # boxed first
    assert meta["world_sha256"] == world_fingerprint(
        json.loads((out / "world" / "manifest.json").read_text())
    )
    assert (out / "report.html").exists()
