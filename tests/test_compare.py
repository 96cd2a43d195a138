"""``pbsd compare``'s parts that need no services: the variant registry, the settings and their
resumption, the learning-curve bands, and the report made from a synthetic summary."""

from __future__ import annotations

import json

import numpy as np
import pytest
import typer

from demo.compare import CompareConfig, check_resume, stage
from demo.compare_report import write_report
from demo.compare_summary import band
from demo.config import DemoConfig
from demo.report import sanity_row
from demo.variants import VARIANTS, merge, variant_spec
from pbsd.accuracy import signed
from pbsd.cli.compare import seed_list
from pbsd.comparison import compare_variants
from proto.runs import PbsdSpec, RunSpec
from proto.templates import ANSWER_FIRST_TEACHER_TEMPLATE, DEFAULT_TEACHER_TEMPLATE

BASE = {
    "name": "demo-grpo",
    "model": {"path": "policy", "dtype": "float32"},
    "data": {"train": "rl.jsonl", "shuffle_seed": 3},
    "rollout": {"group_size": 8, "max_turns": 12},
    "algorithm": {"name": "grpo"},
    "trainer": {"seed": 3, "max_steps": 16},
}


def test_every_variant_is_a_valid_run_spec_that_differs_only_in_its_overrides():
    for name in VARIANTS:
        spec = RunSpec.model_validate(variant_spec(name, BASE))
        assert spec.data.shuffle_seed == 3 and spec.trainer.seed == 3 and spec.rollout.max_turns == 12
    grpo, pbsd = (RunSpec.model_validate(variant_spec(n, BASE)) for n in ("grpo", "pbsd"))
    assert grpo.algorithm.name == "grpo" and pbsd.algorithm.name == "pbsd"
    no_deadband = RunSpec.model_validate(variant_spec("pbsd-no-deadband", BASE)).algorithm
    assert (no_deadband.eps_pos, no_deadband.eps_neg) == (0.0, 0.0)
    replay = RunSpec.model_validate(variant_spec("pbsd-replay", BASE))
    assert replay.algorithm.evidence_routing == "replay" and replay.rollout.return_routed_experts
    assert not replay.trainer.routing_replay  # the policy update is the other variants'
    support = RunSpec.model_validate(variant_spec("pbsd-support", BASE)).algorithm
    assert support.needs_support and not pbsd.algorithm.needs_support
    assert support.model_dump(exclude={"teacher_template"}) == pbsd.algorithm.model_dump(
        exclude={"teacher_template"}
    )
    assert pbsd.algorithm == RunSpec.model_validate(BASE | {"algorithm": {"name": "pbsd"}}).algorithm
    first = RunSpec.model_validate(variant_spec("pbsd-answer-first", BASE)).algorithm
    assert first.teacher_template == ANSWER_FIRST_TEACHER_TEMPLATE != pbsd.algorithm.teacher_template
    # the taught policy's set: the same teacher and ablations in the note it reads
    for name, differs in (
        ("pbsd-support-first", {"teacher_template"}),
        ("pbsd-answer-first-no-deadband", {"eps_pos", "eps_neg"}),
        ("pbsd-answer-first-replay", {"evidence_routing"}),
    ):
        variant = RunSpec.model_validate(variant_spec(name, BASE))
        mine, theirs = variant.algorithm.model_dump(), first.model_dump()
        assert {k for k in mine if mine[k] != theirs[k]} == differs, name
        assert variant.rollout.return_routed_experts == (name == "pbsd-answer-first-replay")
    assert RunSpec.model_validate(variant_spec("pbsd-support-first", BASE)).algorithm.needs_support


def test_the_demo_teaches_pbsd_with_its_template_and_leaves_grpo_and_compare_alone():
    """The demo's PBSD run uses its teacher_template; the GRPO spec, over which pbsd compare builds
    every variant, names none, so compare's "pbsd" stays the paper's default wording."""
    from pathlib import Path

    from demo.run import run_spec

    def spec(config, algorithm):
        return run_spec(config, algorithm, Path("policy"), Path("rl.jsonl"), questions=70)

    pbsd = RunSpec.model_validate(spec(DemoConfig(), "pbsd")).algorithm
    assert pbsd.teacher_template == ANSWER_FIRST_TEACHER_TEMPLATE
    paper = RunSpec.model_validate(spec(DemoConfig(teacher_template="answer"), "pbsd")).algorithm
    assert paper.teacher_template == DEFAULT_TEACHER_TEMPLATE
    assert "teacher_template" not in spec(DemoConfig(), "grpo")["algorithm"]
    own = "Q: {question} A: {answer}"
    assert (
        RunSpec.model_validate(spec(DemoConfig(teacher_template=own), "pbsd")).algorithm.teacher_template
        == own
    )
    with pytest.raises(ValueError, match="teacher_template"):
        DemoConfig(teacher_template="no fields")
    # the paper's other batch reading, one group an update: the trainer gets it, so compare's too
    assert RunSpec.model_validate(spec(DemoConfig(updates_per_step=4), "grpo")).trainer.updates_per_step == 4
    assert RunSpec.model_validate(spec(DemoConfig(), "pbsd")).trainer.updates_per_step == 1


def test_merge_merges_mappings_and_replaces_the_rest():
    assert merge({"a": {"b": 1, "c": [1]}, "d": 2}, {"a": {"c": [2]}, "e": 3}) == {
        "a": {"b": 1, "c": [2]},
        "d": 2,
        "e": 3,
    }
    with pytest.raises(ValueError, match="no variant 'ppo'"):
        variant_spec("ppo", BASE)


def test_settings():
    assert seed_list("3") == [0, 1, 2] and seed_list("4,7") == [4, 7] and seed_list("5,") == [5]
    with pytest.raises(typer.BadParameter):
        seed_list("a")
    with pytest.raises(typer.BadParameter, match="seed 0 alone: '0,'"):
        seed_list("0")
    assert seed_list("0,") == [0]
    with pytest.raises(ValueError, match="unknown variants"):
        CompareConfig(demo=DemoConfig(), variants=["grpo", "ppo"])
    with pytest.raises(ValueError, match="baseline 'grpo'"):
        CompareConfig(demo=DemoConfig(), variants=["pbsd"])
    with pytest.raises(ValueError, match="repeat"):
        CompareConfig(demo=DemoConfig(), seeds=[1, 1])


def test_a_comparison_resumes_only_with_the_settings_its_runs_were_computed_with(tmp_path):
    check_resume(CompareConfig(demo=DemoConfig(steps=4)), tmp_path)
    # more seeds and variants, a longer stall timeout, another bootstrap: the same comparison
    grown = CompareConfig(
        demo=DemoConfig(steps=4, stall_timeout_s=900, eval_concurrency=4),
        variants=["grpo", "pbsd", "pbsd-replay"],
        seeds=[0, 1, 2, 3],
        resamples=500,
    )
    check_resume(grown, tmp_path)
    assert json.loads((tmp_path / "compare-config.json").read_text())["seeds"] == [0, 1, 2, 3]
    with pytest.raises(SystemExit, match=r"other settings \(steps 4 -> 8, eval_samples 1 -> 2\)"):
        check_resume(CompareConfig(demo=DemoConfig(steps=8, eval_samples=2)), tmp_path)


def test_a_run_resumes_where_it_stopped(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    assert stage({}) == "train"
    assert stage({"run_id": "r1", "run_dir": str(run_dir)}) == "train"  # interrupted in training
    assert stage({"run_dir": str(run_dir), "train": {"wall_s": 1}}) == "train"  # its checkpoint is gone
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "final" / "config.json").write_text("{}")
    assert stage({"run_dir": str(run_dir), "train": {"wall_s": 1}}) == "evaluate"
    assert stage({"run_dir": str(run_dir), "train": {}, "eval": {"wall_s": 1}}) == "done"


def test_band_averages_over_the_runs_that_reached_each_step():
    c = band([{1: 0.0, 2: 0.5}, {1: 1.0, 2: 0.25, 3: 0.75}])
    assert c == {
        "steps": [1, 2, 3],
        "mean": [0.5, 0.375, 0.75],
        "min": [0.0, 0.25, 0.75],
        "max": [1.0, 0.5, 0.75],
        "runs": [2, 2, 1],
    }


SANITY = {
    "answer_free_turns": 120.0,
    "answer_free_mean_s": -0.0123,
    "correct_final_turns": 10.0,
    "correct_final_favoured_frac": 0.3,
    "wrong_final_turns": 50.0,
    "wrong_final_disfavoured_frac": 0.52,
    "evidence_queries_grounded_mean_s": -0.01,
    "evidence_queries_made_up_mean_s": -0.03,
    "noise_std": 2e-7,
    "noise_outside_deadband_frac": 0.0,
    "within_noise_floor_frac": 0.01,
}


def _summary(statistics, runs, pending):
    demo = DemoConfig().model_dump(mode="json")
    return {
        "settings": {
            "demo": demo,
            "variants": ["grpo", "pbsd"],
            "seeds": [0, 1, 2],
            "baseline": "grpo",
            "resamples": 300,
            "bootstrap_seed": 0,
        },
        "commit": {"sha": "abc123", "dirty": False},
        "machine": {"cpu": "a CPU", "cores": 2, "torch": "2.x"},
        "seconds": 4321.0,
        "eval_samples": 2,
        "questions": {"train": 118, "evaluation": 6, "difficulty": ["easy"]},
        "variants": {"grpo": {"algorithm": {"name": "grpo"}}, "pbsd": {"algorithm": {"name": "pbsd"}}},
        "before": {"mean@2": 0.25},
        "statistics": statistics,
        "runs": runs,
        "pending": pending,
        "curves": {
            v: {
                "accuracy": band([{1: 0.1, 2: 0.2}, {1: 0.15, 2: 0.3}]),
                **({"answer_free_mean_s": band([{1: -0.02, 2: -0.01}])} if v == "pbsd" else {}),
            }
            for v in ("grpo", "pbsd")
        },
        "sanity": {"grpo": {}, "pbsd": SANITY},
    }


def _run(variant, seed, acc):
    return {
        "variant": variant,
        "seed": seed,
        "run_id": f"run-{variant}-{seed}",
        "steps": 16,
        "train": {"wall_s": 900.0, "cpu_s": {"rollout": 700.0, "scorer": 200.0}, "loadavg": [2, 2.5, 2]},
        "eval": {"wall_s": 300.0, "cpu_s": 500.0, "loadavg": [2, 2, 2]},
        "mean@2": acc,
        "change": {"difference": acc - 0.25, "ci95": [-0.1, 0.2], "better": 2, "worse": 1},
    }


def test_the_report_shows_every_figure_of_a_summary(tmp_path):
    rng = np.random.default_rng(0)
    grpo, pbsd = rng.integers(0, 3, (2, 6)) / 2, rng.integers(0, 3, (1, 6)) / 2
    before = np.full(6, 0.25)
    stats = compare_variants({"grpo": grpo, "pbsd": pbsd}, baseline="grpo", before=before, resamples=300)
    runs = [_run("grpo", s, float(grpo[s].mean())) for s in (0, 1)] + [_run("pbsd", 0, float(pbsd[0].mean()))]
    page = write_report(_summary(stats, runs, ["grpo-s2", "pbsd-s1", "pbsd-s2"]), tmp_path).read_text()

    p = stats["variants"]["pbsd"]
    low, high = p["difference"]["ci95"]
    assert f"{p['difference']['mean']:+.3f} [{low:+.3f}, {high:+.3f}]" in page
    g = stats["variants"]["grpo"]
    assert f"{g['mean']:.3f} [{g['ci95'][0]:.3f}, {g['ci95'][1]:.3f}]" in page
    assert ", ".join(f"{r['mean']:.3f}" for r in g["per_run"]) in page  # each seed's figure
    assert "Pending runs" in page and "grpo-s2, pbsd-s1, pbsd-s2" in page
    assert "Does the teacher read x*?" in page and "<td>PBSD</td>" in page and "<td>GRPO</td>" not in page
    assert "-0.0123" in page and "30%" in page
    assert "run-pbsd-0" in page and "<td>15.0</td>" in page  # wall minutes of training
    assert "two-level paired bootstrap (300 resamples" in page and "abc123" in page
    assert page.count("data:image/png;base64,") == 4
    assert page.count("<figcaption>") == 4 and "contains 0 means the comparison cannot tell" in page
    assert {p.name for p in (tmp_path / "figures").iterdir()} == {
        "accuracy.png",
        "difference.png",
        "curve_accuracy.png",
        "curve_answer_free.png",
    }
    _columns_line_up(page)


def _columns_line_up(page: str) -> None:
    """Every row of every table has as many cells as its header: the teacher table's header once
    lacked the room column its rows carry, so every figure from there on sat under the wrong heading."""
    import re

    for table in re.findall(r"<table>(.*?)</table>", page, re.S):
        header, *rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)
        for row in rows:
            assert row.count("<td") == header.count("<th>"), (header, row)


def test_a_difference_over_seeds_is_shown_beside_the_bootstrap(tmp_path):
    rng = np.random.default_rng(1)
    grpo, pbsd = rng.integers(0, 3, (3, 6)) / 2, rng.integers(0, 3, (3, 6)) / 2
    stats = compare_variants(
        {"grpo": grpo, "pbsd": pbsd}, baseline="grpo", before=np.full(6, 0.25), resamples=300
    )
    runs = [_run(v, s, float(a[s].mean())) for v, a in (("grpo", grpo), ("pbsd", pbsd)) for s in range(3)]
    page = write_report(_summary(stats, runs, []), tmp_path).read_text()
    over = stats["variants"]["pbsd"]["difference"]["over_seeds"]
    assert f"{signed(over['mean'])} [{signed(over['ci95'][0])}, {signed(over['ci95'][1])}]" in page
    assert "-0.000" not in page
    _columns_line_up(page)


def test_the_null_pass_share_says_when_there_is_no_deadband():
    figures = SANITY | {"noise_outside_deadband_frac": 0.064}
    assert "<td>6% (no deadband)</td>" in sanity_row("pbsd", figures, PbsdSpec(eps_pos=0, eps_neg=0))
    assert "<td>6%</td>" in sanity_row("pbsd", figures, PbsdSpec())


def test_a_report_before_any_run_finished(tmp_path):
    summary = _summary(None, [], ["grpo-s0", "pbsd-s0"]) | {"before": None, "curves": {}, "sanity": {}}
    page = write_report(summary, tmp_path).read_text()
    assert "Pending runs" in page and "data:image/png" not in page


def test_the_command_line_summary_shows_the_interval_over_seeds():
    from pbsd.cli.compare import describe

    grpo, pbsd = np.zeros((3, 10)), np.eye(3, 10)  # each seed one question better: +0.1 on every seed
    stats = compare_variants({"grpo": grpo, "pbsd": pbsd}, baseline="grpo", resamples=100)
    text = describe({"eval_samples": 1, "statistics": stats, "pending": [], "report": "r.html"})
    assert "minus grpo +0.100 [+0.000, " in text and "over seeds [+0.100, +0.100]" in text
