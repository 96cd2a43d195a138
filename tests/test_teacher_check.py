"""``pbsd teacher check``: the teacher sanity figures of a checkpoint on a question set, without training."""

from __future__ import annotations

import json
import math

from proto.sanity import NoiseFloor, TeacherSanity
from services.scorer.finals import PARTS
from services.scorer.sanity import final_kind
from services.trainer.viewer import load_groups


def test_pbsd_teacher_check_cli(tiny_world, tiny_checkpoint, tmp_path):
    """The command samples a group per question, scores it with the scorer's code and reports the
    figures the trainer would record for those groups."""
    from typer.testing import CliRunner

    from pbsd.cli import app

    out, viewer, finals = tmp_path / "check.json", tmp_path / "viewer.html", tmp_path / "finals.jsonl"
    args = ["teacher", "check", "--model", str(tiny_checkpoint), "--corpus", str(tiny_world / "corpus.jsonl")]
    args += ["--questions", str(tiny_world / "questions" / "validation.jsonl"), "--limit", "2"]
    args += ["--samples", "2", "--max-turns", "2", "--max-tokens-per-turn", "8", "--seed", "3"]
    kept = tmp_path / "kept"
    result = CliRunner().invoke(
        app,
        [
            *args,
            "--out",
            str(out),
            "--viewer",
            str(viewer),
            "--save-groups",
            str(kept),
            "--finals",
            str(finals),
        ],
    )
    assert result.exit_code == 0, result.output

    def strict(constant: str):
        raise AssertionError(f"{constant} in the report: not JSON")

    report = json.loads(out.read_text(), parse_constant=strict)
    assert report["questions"] == 2 and report["samples"] == 2 and sum(report["finish_reasons"].values()) == 4
    sanity = TeacherSanity.model_validate(report["sanity"])
    noise = NoiseFloor.model_validate(report["noise"])
    assert report["figures"]["answer_free_turns"] == sanity.answer_free.turns > 0
    assert report["figures"]["noise_tokens"] == noise.tokens > 0  # one null sample per group
    assert [c["figure"] for c in report["checks"]][:2] == [
        "answer_free_mean_s",
        "correct_final_favoured_frac",
    ]
    assert "answer-free turns: mean s" in result.output and "noise floor" in result.output
    assert "data-testid='sanity'" in viewer.read_text()
    rows = [json.loads(line) for line in finals.read_text().splitlines()]
    assert report["finals"]["correct_finals"] == sum(r["correct"] for r in rows)
    assert all(len(r["tokens"]) == len(r["student"]) == len(r["teacher"]) for r in rows)
    assert "correct finals naming the answer" in result.output and "by outcome and grounding" in result.output
    assert "where the correct finals' room lies" in result.output
    assert set(report["finals"]["correct_by_part"]) == set(PARTS)
    groups = load_groups(kept)  # as a run keeps them: the report's and the viewer's input
    assert len(groups) == 2 and all(g.scored and g.diagnostics.noise.tokens > 0 for _, g in groups)
    answered = [
        final_kind(t) in ("correct_final", "wrong_final") and not math.isnan(s[-1])
        for _, g in groups
        for t, s in zip(g.group.trajectories, g.turn_evidence, strict=True)
    ]
    assert len(rows) == sum(answered)  # one per scored final answer
    bad = CliRunner().invoke(app, [*args, "--out", str(out), "--evidence-routing", "sideways"])
    assert bad.exit_code == 2 and "evidence_routing" in bad.output
