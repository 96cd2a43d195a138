"""A run's saved groups paged a step file at a time: the same page as from the groups in memory,
decoding only the files whose groups it shows a second time."""

from __future__ import annotations

import pytest

from agent.chat import ChatTokenizer
from proto.runs import PbsdSpec
from services.model.checkpoint import load_model
from services.scorer.backends import LocalScorer
from services.scorer.evidence import score_group
from services.trainer import saved_groups
from services.trainer.checkpoints import save_groups
from services.trainer.viewer import load_groups, render_viewer, run_page, sanity_summary, viewer_data
from tests.test_scorer import TEMPLATE, _group

REWARDS = ((1.0, 0.0, 1.0), (0.0, 0.0, 1.0), (0.0, 1.0, 0.0))


@pytest.fixture
async def run_dir(tiny_checkpoint, tmp_path):
    """Six steps of two groups each (three trajectories a group), scored by the tiny model."""
    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    scorer = LocalScorer(load_model(tiny_checkpoint))
    spec = PbsdSpec(teacher_template=TEMPLATE, noise_floor_samples=1)
    scored = [await score_group(_group(tok, spec, rewards=r), tok, scorer) for r in REWARDS]
    out = tmp_path / "run"
    for step in range(1, 7):
        save_groups(out, step, [scored[step % 3], scored[(step + 1) % 3]])
    return out


@pytest.mark.parametrize("limit", [400, 13, 4])  # all of it; two groups a step; fewer steps than saved
def test_a_page_made_a_file_at_a_time_is_the_page_made_in_memory(
    run_dir, tiny_checkpoint, limit, monkeypatch
):
    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    groups = load_groups(run_dir)
    want = render_viewer(viewer_data(groups, tok, limit=limit), "t", sanity_summary(groups))
    read, real = [], saved_groups._read
    monkeypatch.setattr(saved_groups, "_read", lambda path: read.append(path.name) or real(path))
    assert run_page(run_dir, tok, "t", limit=limit) == want
    files = sorted(p.name for p in (run_dir / "groups").iterdir())
    shown = sorted({f"step-{row['step']:06d}.msgpack" for row in viewer_data(groups, tok, limit=limit)})
    assert read == files + shown  # each file once for the index, then only those it shows from
    assert len(shown) < len(files) or limit == 400


def test_a_run_that_saved_no_groups_has_no_page(tmp_path, tiny_checkpoint):
    assert run_page(tmp_path, ChatTokenizer.from_pretrained(tiny_checkpoint), "t") is None


def test_a_step_file_written_again_while_the_page_is_made_starts_it_over(
    run_dir, tiny_checkpoint, monkeypatch
):
    """A resumed run writes its steps again: the groups the index counted are then not the file's,
    and a page made of both would show the wrong groups (or fail on an index past the file's end)."""
    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    index = saved_groups.index_groups(run_dir)
    first = load_groups(run_dir)
    save_groups(run_dir, 1, [first[0][1]])  # step 1 again, with one group of its two
    with pytest.raises(saved_groups.GroupsChanged):
        index.load(index.shown(400))
    real, calls = saved_groups.GroupIndex.load, []

    def rewritten_once(self, indices):
        if not calls:
            save_groups(run_dir, 2, [first[2][1]])  # step 2 written again between index and load
        calls.append(len(indices))
        return real(self, indices)

    monkeypatch.setattr(saved_groups.GroupIndex, "load", rewritten_once)
    page = run_page(run_dir, tok, "t")
    groups = load_groups(run_dir)
    assert len(groups) == len(first) - 2 and len(calls) == 2
    assert page == render_viewer(viewer_data(groups, tok), "t", sanity_summary(groups))  # what is there now


def test_iter_groups_reads_a_step_file_only_when_its_groups_are_wanted(run_dir, monkeypatch):
    """`pbsd teacher tally` sums a run of any length in one pass: the groups of one step at a time."""
    read, real = [], saved_groups._read
    monkeypatch.setattr(saved_groups, "_read", lambda path: read.append(path.name) or real(path))
    groups = saved_groups.iter_groups(run_dir)
    assert read == []
    assert [next(groups)[0], next(groups)[0]] == [1, 1] and read == ["step-000001.msgpack"]
    assert next(groups)[0] == 2 and read == ["step-000001.msgpack", "step-000002.msgpack"]
    rest = list(groups)
    assert len(rest) == 2 * 6 - 3 and len(read) == 6


async def test_a_step_file_is_written_whole_or_not_at_all(run_dir, monkeypatch):
    """A crash mid-write left a cut-off step file, and every read of the run's groups (the viewer,
    the report, teacher tally) failed on it. The file is now written aside and renamed into place:
    a write that dies before the rename leaves the step's old groups."""
    import os

    from services.trainer import checkpoints

    before = [g.group.message_id for s, g in load_groups(run_dir) if s == 2]

    def dies(_fd):  # the machine goes down after the bytes are written, before the rename
        raise OSError("power lost")

    monkeypatch.setattr(checkpoints.os, "fsync", dies)
    with pytest.raises(OSError, match="power lost"):
        save_groups(run_dir, 2, [])
    monkeypatch.setattr(checkpoints.os, "fsync", os.fsync)
    assert [g.group.message_id for s, g in load_groups(run_dir) if s == 2] == before
    assert len(saved_groups.step_files(run_dir)) == 6  # the half-written file is no step file


def test_a_record_torn_by_a_crash_is_dropped_not_a_failed_resume(tmp_path, caplog):
    """The machine going down mid-append leaves a torn last line in metrics.jsonl: the resume's
    trim of the series then raised on it, so the run could never open again, and the viewer's
    read of the records failed."""
    from services.trainer.checkpoints import keep_steps
    from services.trainer.viewer import load_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {s}, "loss": 0.5}}\n' for s in range(1, 5)) + '{"step": 5, "lo')
    assert [r["step"] for r in load_metrics(tmp_path)] == [1, 2, 3, 4]
    with caplog.at_level("WARNING"):
        keep_steps(path, 3)
    assert "torn JSONL record" in caplog.text
    assert [r["step"] for r in load_metrics(tmp_path)] == [1, 2, 3]
    assert path.read_text().endswith("\n") and not list(tmp_path.glob(".*.new"))
