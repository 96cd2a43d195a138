"""``pbsd teacher tally``: saved groups sorted again from their stored evidence, from folders or
from a comparison's trained runs."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from agent.chat import ChatTokenizer
from pbsd.cli import app
from proto.runs import PbsdSpec
from proto.sanity import TeacherSanity
from services.scorer.evidence import score_group
from services.trainer.checkpoints import save_groups
from tests.test_grounding import _search
from tests.test_scorer import TEMPLATE, _trajectory, group_of
from tests.test_teacher_sanity import RESULT, _hand_made_group, _reading_teacher


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return ChatTokenizer.from_pretrained(tiny_checkpoint)


async def test_tally_sorts_saved_groups_again_from_their_evidence(tok, tiny_checkpoint, tmp_path):
    """`pbsd teacher tally` reads saved groups and classifies their turns as the scorer does now: a
    group saved with tallies of an earlier classification (here: none at all) gets the figures the
    scorer gives today, summed over every folder given, without a likelihood pass."""
    spec = PbsdSpec(teacher_template=TEMPLATE, noise_floor_samples=0)
    stray = _trajectory(tok, [_search("Zorbel river"), "</arguments>"], RESULT, i=3, reward=0.0)
    group = group_of([*_hand_made_group(tok, spec).trajectories, stray], spec)
    scored = await score_group(group, tok, _reading_teacher(tok, gain=0.5))
    blank = scored.model_copy(
        update={"diagnostics": scored.diagnostics.model_copy(update={"sanity": TeacherSanity()})}
    )
    save_groups(tmp_path / "a", 0, [scored])
    save_groups(tmp_path / "b", 3, [blank])
    out = tmp_path / "tally.json"
    args = ["teacher", "tally", "--model", str(tiny_checkpoint), "--out", str(out)]
    result = CliRunner().invoke(
        app, [*args, "--groups", str(tmp_path / "a"), "--groups", str(tmp_path / "b")]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    want = (scored.diagnostics.sanity + scored.diagnostics.sanity).figures()
    want.pop("correct_final_room_frac")
    assert report["figures"] == pytest.approx(want)
    assert report["figures"]["unboxed_final_turns"] == 2 and report["figures"]["wrong_final_turns"] == 2
    assert report["as_stored"]["wrong_final_turns"] == 1  # the blank copy stored no tallies
    assert "finals that box nothing 2" in result.output
    missing = CliRunner().invoke(app, [*args, "--groups", str(tmp_path)])
    assert missing.exit_code != 0 and "no scored PBSD groups" in missing.output
    # groups of another deadband are not summed with these: their figures would mean nothing together
    algorithm = scored.group.algorithm.model_copy(update={"eps_pos": 0.0, "eps_neg": 0.0})
    other = scored.model_copy(update={"group": scored.group.model_copy(update={"algorithm": algorithm})})
    save_groups(tmp_path / "c", 1, [other])
    mixed = CliRunner().invoke(app, [*args, "--groups", str(tmp_path / "a"), "--groups", str(tmp_path / "c")])
    assert mixed.exit_code == 2 and "the groups use 2 deadbands; tally them apart" in mixed.output
    # a comparison's folder: the variant's seeds, not a variant whose name starts the same
    cmp = tmp_path / "cmp"
    (cmp / "results").mkdir(parents=True)
    results = {"pbsd-x-s0": "r0", "pbsd-x-s1": None, "pbsd-x-s2": "r2", "pbsd-x-no-deadband-s0": "r1"}
    for name, run in results.items():  # s1 not started, s2 submitted but not trained
        record = {"run_id": run, **({"train": {"wall_s": 1.0}} if run != "r2" else {})} if run else {}
        (cmp / "results" / f"{name}.json").write_text(json.dumps(record))
    save_groups(cmp / "runs" / "r0", 0, [scored])
    save_groups(cmp / "runs" / "r1", 0, [scored, scored])
    save_groups(cmp / "runs" / "r2", 0, [scored, scored, scored])
    result = CliRunner().invoke(app, [*args, "--compare", str(cmp), "--variant", "pbsd-x"])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["groups"] == 1 and "1 trained runs of 3 seeds" in result.output
    shutil.rmtree(cmp / "runs" / "r0")
    lost = CliRunner().invoke(app, [*args, "--compare", str(cmp), "--variant", "pbsd-x"])
    assert lost.exit_code != 0 and "kept no scored groups: r0" in lost.output
    alone = CliRunner().invoke(app, [*args, "--compare", str(cmp)])
    assert alone.exit_code != 0 and "go together" in alone.output


async def test_groups_written_with_another_tokenizer_are_refused(
    tok, tiny_checkpoint, moe_checkpoint, tmp_path
):
    """Read with another checkpoint's tokenizer, saved groups decode to other text: `tally` gave
    figures sorted from it, and `drift` failed inside on a role it could not find."""
    spec = PbsdSpec(teacher_template=TEMPLATE, noise_floor_samples=0)
    scored = await score_group(_hand_made_group(tok, spec), tok, _reading_teacher(tok, gain=0.5))
    save_groups(tmp_path / "a", 0, [scored])
    for command in ("tally", "drift"):
        args = ["teacher", command, "--groups", str(tmp_path / "a"), "--model"]
        wrong = CliRunner().invoke(app, [*args, str(moe_checkpoint)])
        assert wrong.exit_code == 2 and "not written with" in wrong.output, (command, wrong.output)
        assert CliRunner().invoke(app, [*args, str(tiny_checkpoint)]).exit_code == 0, command


def test_a_tokenizer_that_normalises_still_reads_its_own_groups(tiny_checkpoint, tmp_path):
    """Qwen's tokenizer normalises to NFC: a question written with a combining accent comes back
    composed in the decoded prompt, and a comparison with the raw question refused the run's own
    checkpoint. The question goes through the tokenizer before the comparison."""
    import json as _json

    from pbsd.cli.inputs import scored_with
    from proto import examples as ex

    folder = tmp_path / "nfc"
    shutil.copytree(tiny_checkpoint, folder)
    config = _json.loads((folder / "tokenizer.json").read_text())
    config["normalizer"] = {"type": "NFC"}
    (folder / "tokenizer.json").write_text(_json.dumps(config))
    nfc = ChatTokenizer.from_pretrained(folder)
    question = "Who founded Cafe\u0301 Nero?"
    group = ex.example_group(1)
    prompt = np.asarray(nfc.prompt_ids("You are a search agent.", question), dtype=np.int32)
    trajectory = group.trajectories[0].model_copy(update={"prompt_ids": prompt})
    group = group.model_copy(update={"question": question, "trajectories": (trajectory,)})
    assert question not in nfc.decode(prompt)  # the case: the raw question is not in the prompt
    scored_with(nfc, group, folder, tmp_path)  # and no refusal
