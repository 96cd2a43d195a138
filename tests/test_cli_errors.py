"""Every command, given what a user gets wrong (a bad path or file, a service that does not
answer, a world too small), says so in one line on stderr and exits non-zero: no traceback.

A command added to the CLI needs a case in CASES (test_every_command_has_a_case says which)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from typer.testing import CliRunner

from pbsd.cli import app
from services.local_redis import free_port

runner = CliRunner()

# commands no user input can make fail: they take no path, file or service
NOTHING_TO_GET_WRONG = {"version", "schemas export", "schemas check"}


@pytest.fixture(scope="module")
def f(tiny_world, tmp_path_factory, checkpoint_stub):
    """Bad inputs, each of one kind, beside a good world and a checkpoint that only looks like one
    (a directory with a config.json: the commands must refuse before they would load it)."""
    tmp = tmp_path_factory.mktemp("bad-inputs")
    (tmp / "not-yaml.yaml").write_text("steps: [1, 2\n")
    (tmp / "list.yaml").write_text("- steps\n")
    (tmp / "bad-setting.yaml").write_text("steps: many\n")
    (tmp / "negative.yaml").write_text("eval_questions: -5\n")
    (tmp / "garbage.jsonl").write_text("not json at all\n")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "no-messages.jsonl").write_text('{"text": "hello"}\n')
    (tmp / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hello"}]}\n')
    (tmp / "spec.yaml").write_text("name: x\nmodel: {path: m}\ndata: {train: t}\n")
    (tmp / "not-a-spec.yaml").write_text("name: x\nrollout: {group_size: 0}\n")
    (tmp / "nan-spec.yaml").write_text("name: x\ntrainer: {lr: .nan}\n")
    (tmp / "deep.jsonl").write_text("[" * 100_000 + "\n")
    bomb, below = "a: &a [x, x, x, x, x, x, x, x, x]\n", "a"  # 9**9 values once expanded
    for name in "bcdefghi":
        bomb, below = bomb + f"{name}: &{name} [{', '.join(['*' + below] * 9)}]\n", name
    (tmp / "alias-bomb.yaml").write_text(bomb)
    (tmp / "holds-itself.yaml").write_text("name: &a [1, *a]\n")
    omap, below = "a: &a [x, x, x, x, x, x, x, x, x]\n", "a"  # the same inside !!omap pairs (tuples)
    for name in "bcdefghi":
        omap, below = omap + f"{name}: !!omap [{{k: &{name} [{', '.join(['*' + below] * 9)}]}}]\n", name
    (tmp / "omap-bomb.yaml").write_text(omap)
    (tmp / "deep.yaml").write_text("[" * 20_000 + "]" * 20_000 + "\n")
    (tmp / "long-number.jsonl").write_text('{"messages": ' + "1" * 5000 + "}\n")
    (tmp / "questions.jsonl").write_text(
        "".join(json.dumps({"id": f"q{i}", "question": f"Q{i}?", "answer": "A"}) + "\n" for i in range(3))
    )
    other = {"per_question": {"elsewhere": {"correct": [True, False]}}}
    (tmp / "other-report.json").write_text(json.dumps(other))
    (tmp / "not-a-report.json").write_text(json.dumps({"accuracy": 0.5}))
    (tmp / "earlier-compare").mkdir()
    (tmp / "earlier-compare" / "compare-config.json").write_text(json.dumps({"demo": {"steps": 7}}))
    looks_like_a_checkpoint = checkpoint_stub(tmp / "ckpt")
    broken = {
        "no-type": {"config.json": '{"num_hidden_layers": 2}'},
        "no-weights": {"model.safetensors": None},
        "cut-weights": {"model.safetensors": (10**6).to_bytes(8, "little") + b'{"a": '},
        # a whole header, but the copy stopped before the tensor it lists
        "cut-tensors": {
            "model.safetensors": (62).to_bytes(8, "little")
            + b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'
        },
        "no-tokenizer": {"tokenizer.json": None},
    }
    for name, files in broken.items():
        checkpoint_stub(tmp / name, **files)
    shutil.copytree(tiny_world, tmp / "changed-world")
    shutil.copytree(tiny_world, tmp / "other-world")
    (tmp / "cut-groups" / "groups").mkdir(parents=True)
    (tmp / "cut-groups" / "groups" / "step-000001.msgpack").write_bytes(b"\x92\x81")  # cut off mid-list
    manifest = json.loads((tmp / "other-world" / "manifest.json").read_text())
    manifest["files"]["corpus.jsonl"] = "0" * 64  # another world's corpus, as far as the check can tell
    (tmp / "other-world" / "manifest.json").write_text(json.dumps(manifest))
    with (tmp / "changed-world" / "corpus.jsonl").open("a") as file:
        file.write("{}\n")
    return SimpleNamespace(
        tmp=tmp,
        missing=tmp / "missing",
        world=tiny_world,
        ckpt=looks_like_a_checkpoint,
        closed=f"http://127.0.0.1:{free_port('127.0.0.1')}",  # nothing listens there
    )


def _teach(f):
    return [
        "teacher",
        "teach",
        "--model",
        str(f.ckpt),
        "--data",
        str(f.tmp / "chat.jsonl"),
        "--out",
        str(f.tmp / "taught"),
    ]


def _eval(f, *extra):
    base = {"--model": f.ckpt, "--questions": f.tmp / "questions.jsonl", "--corpus": f.world / "corpus.jsonl"}
    for name, value in zip(extra[::2], extra[1::2], strict=True):
        base[name] = value
    return ["eval", *(str(x) for name, value in base.items() if value is not None for x in (name, value))]


def _teacher(f, *extra):
    return ["teacher", "check", *_eval(f, *extra)[1:]]


# ("<command>: <what is wrong>", its arguments from the fixture, what the line says, the exit code)
CASES = [
    ("runs list: no trainer", lambda f: ["runs", "list", "--url", f.closed], "no trainer at", 1),
    ("runs show: no trainer", lambda f: ["runs", "show", "r1", "--url", f.closed], "PBSD_TRAINER_URL", 1),
    ("runs evals: no trainer", lambda f: ["runs", "evals", "r1", "--url", f.closed], "pbsd serve trainer", 1),
    ("runs watch: no trainer", lambda f: ["runs", "watch", "r1", "--url", f.closed], "no trainer at", 1),
    ("runs cancel: no trainer", lambda f: ["runs", "cancel", "r1", "--url", f.closed], "no trainer at", 1),
    ("runs delete: no trainer", lambda f: ["runs", "delete", "r1", "--url", f.closed], "no trainer at", 1),
    ("runs list: not a URL", lambda f: ["runs", "list", "--url", "trainer:8000"], "not a usable URL", 1),
    ("runs list: a port past 65535", lambda f: ["runs", "list", "--url", "http://127.0.0.1:99999"], "is not a URL (Port out of range", 1),
    ("runs list: port 0", lambda f: ["runs", "list", "--url", "http://127.0.0.1:0"], "is not a URL (port 0)", 1),
    ("runs submit: no trainer", lambda f: ["runs", "submit", str(f.tmp / "spec.yaml"), "--url", f.closed], "--url", 1),
    ("runs submit: not a spec", lambda f: ["runs", "submit", str(f.tmp / "not-a-spec.yaml"), "--url", f.closed], "not a run specification: model: Field required; data: Field required; rollout.group_size", 1),
    ("runs submit: missing spec", lambda f: ["runs", "submit", str(f.missing)], "does not exist", 2),
    ("runs submit: a directory", lambda f: ["runs", "submit", str(f.tmp)], "is a directory", 2),
    ("runs submit: not YAML", lambda f: ["runs", "submit", str(f.tmp / "not-yaml.yaml")], "not valid YAML", 1),
    ("runs submit: an alias bomb", lambda f: ["runs", "submit", str(f.tmp / "alias-bomb.yaml"), "--url", f.closed], "it holds more than 100,000 values once its aliases are expanded", 1),
    ("runs submit: an alias bomb in pairs", lambda f: ["runs", "submit", str(f.tmp / "omap-bomb.yaml"), "--url", f.closed], "once its aliases are expanded", 1),
    ("runs submit: a value inside itself", lambda f: ["runs", "submit", str(f.tmp / "holds-itself.yaml"), "--url", f.closed], "an alias names a value that holds it", 1),
    ("runs submit: nested too deep", lambda f: ["runs", "submit", str(f.tmp / "deep.yaml"), "--url", f.closed], "nested too deep to read", 1),
    ("compare: an alias bomb", lambda f: ["compare", "--out", str(f.missing), "--config", str(f.tmp / "alias-bomb.yaml")], "once its aliases are expanded", 1),
    ("runs submit: NaN", lambda f: ["runs", "submit", str(f.tmp / "nan-spec.yaml"), "--url", f.closed], "cannot be sent as JSON", 1),
    ("world build: too few entities", lambda f: ["world", "build", "--out", str(f.missing), "--entities", "50"], "at least 100", 2),
    ("world demo-questions: no world", lambda f: ["world", "demo-questions", "--world", str(f.missing), "--out", str(f.missing)], "does not exist", 2),
    ("world demo-questions: not a world", lambda f: ["world", "demo-questions", "--world", str(f.tmp), "--out", str(f.missing)], "not a world", 2),
    ("world demo-questions: broken config", lambda f: ["world", "demo-questions", "--world", str(f.world), "--out", str(f.missing), "--config", str(f.tmp / "not-yaml.yaml")], "line 2", 1),
    ("world fingerprint: no world", lambda f: ["world", "fingerprint", "--world", str(f.missing)], "does not exist", 2),
    ("eval: the questions of one world, the corpus of another", lambda f: _eval(f, "--questions", f.world / "questions" / "rl.jsonl", "--corpus", f.tmp / "other-world" / "corpus.jsonl"), "no answer would be found in it", 2),
    ("teacher check: the questions of one world, the corpus of another", lambda f: _teacher(f, "--questions", f.world / "questions" / "rl.jsonl", "--corpus", f.tmp / "other-world" / "corpus.jsonl"), "no answer would be found in it", 2),
    ("world fingerprint: a file changed since the build", lambda f: ["world", "fingerprint", "--world", str(f.tmp / "changed-world")], "corpus.jsonl has changed since the world was built", 2),
    ("world fingerprint: stamp no checkpoint", lambda f: ["world", "fingerprint", "--world", str(f.world), "--stamp", str(f.tmp)], "not a model checkpoint", 2),
    ("world sft-data: no world", lambda f: ["world", "sft-data", "--world", str(f.missing), "--out", str(f.missing)], "write one with `pbsd world build`", 2),
    ("world sft-data: no such final", lambda f: ["world", "sft-data", "--world", str(f.world), "--out", str(f.missing), "--final", "bold"], "'bold' is not one of restate, boxed", 2),
    ("world sft-data: no such split", lambda f: ["world", "sft-data", "--world", str(f.world), "--out", str(f.missing), "--split", "train"], "no split 'train' (it has: rl, sft, validation)", 2),
    ("model tiny: no world", lambda f: ["model", "tiny", "--world", str(f.missing), "--out", str(f.missing)], "--world", 2),
    ("model tiny: sft data nested past the stack", lambda f: ["model", "tiny", "--world", str(f.world), "--out", str(f.missing), "--sft-data", str(f.tmp / "deep.jsonl")], "line 1: not valid JSON", 2),
    ("model tiny: sft data with a 5,000-digit number", lambda f: ["model", "tiny", "--world", str(f.world), "--out", str(f.missing), "--sft-data", str(f.tmp / "long-number.jsonl")], "line 1: not valid JSON", 2),
    ("model tiny: sft data not JSON", lambda f: ["model", "tiny", "--world", str(f.world), "--out", str(f.missing), "--sft-data", str(f.tmp / "garbage.jsonl")], "line 1: not valid JSON", 2),
    ("eval: a config without its model type", lambda f: _eval(f, "--model", f.tmp / "no-type"), "config.json names no model_type", 2),
    ("eval: a checkpoint without weights", lambda f: _eval(f, "--model", f.tmp / "no-weights"), "no weights in it", 2),
    ("eval: tensors cut off", lambda f: _eval(f, "--model", f.tmp / "cut-tensors"), "model.safetensors is cut off", 2),
    ("eval: weights cut off", lambda f: _eval(f, "--model", f.tmp / "cut-weights"), "model.safetensors is cut off", 2),
    ("teacher probe: a checkpoint without a tokenizer", lambda f: ["teacher", "probe", "--model", str(f.tmp / "no-tokenizer"), "--data", str(f.tmp / "chat.jsonl")], "no tokenizer in it", 2),
    ("model tiny: a hidden size off the 16-byte grid", lambda f: ["model", "tiny", "--world", str(f.world), "--out", str(f.missing), "--hidden-size", "30"], "not a multiple of 4", 2),
    ("model tiny: groups that do not divide the heads", lambda f: ["model", "tiny", "--world", str(f.world), "--out", str(f.missing), "--kv-heads", "3"], "3 key-value groups do not divide 4 heads", 2),
    ("model tiny: more routed experts than experts", lambda f: ["model", "tiny", "--world", str(f.world), "--out", str(f.missing), "--top-k", "5", "--experts", "2"], "top-5 routing needs at least as many experts", 2),
    ("model tiny: copy heads without entity tokens", lambda f: ["model", "tiny", "--world", str(f.world), "--out", str(f.missing), "--copy-heads"], "they need entity tokens", 2),
    ("model copy-probe: no conversations", lambda f: ["model", "copy-probe", "--model", str(f.ckpt), "--data", str(f.tmp / "empty.jsonl")], "holds no conversation", 2),
    ("compare: an unknown variant", lambda f: ["compare", "--out", str(f.missing), "--variants", "bogus"], "error: unknown variants ['bogus']", 1),
    ("model copy-probe: no model", lambda f: ["model", "copy-probe", "--model", str(f.tmp), "--data", str(f.tmp / "garbage.jsonl")], "no config.json", 2),
    ("model copy-probe: no data", lambda f: ["model", "copy-probe", "--model", str(f.ckpt), "--data", str(f.missing)], "does not exist", 2),
    ("sft: not conversations", lambda f: ["sft", "--data", str(f.tmp / "no-messages.jsonl"), "--model", str(f.ckpt), "--out", str(f.missing)], "not a conversation", 2),
    ("sft: no model", lambda f: ["sft", "--data", str(f.tmp / "chat.jsonl"), "--model", str(f.missing), "--out", str(f.missing)], "--model", 2),
    ("demo: missing config", lambda f: ["demo", "--config", str(f.missing)], "does not exist", 2),
    ("demo: config not a mapping", lambda f: ["demo", "--config", str(f.tmp / "list.yaml")], "not a mapping", 1),
    ("demo: a bad setting", lambda f: ["demo", "--config", str(f.tmp / "bad-setting.yaml")], "steps: Input should be a valid integer", 1),
    ("demo: no policy", lambda f: ["demo", "--policy", str(f.missing)], "--policy", 2),
    ("compare: unknown variant", lambda f: ["compare", "--out", str(f.missing), "--variants", "grpo,ppo"], "unknown variants ['ppo']", 1),
    ("compare: seeds not numbers", lambda f: ["compare", "--out", str(f.missing), "--seeds", "a,b"], "a number of seeds K", 2),
    ("compare: no policy", lambda f: ["compare", "--out", str(f.missing), "--policy", str(f.missing)], "--policy", 2),
    ("compare: a bad setting", lambda f: ["compare", "--out", str(f.missing), "--config", str(f.tmp / "bad-setting.yaml")], "steps: Input should be a valid integer", 1),
    ("compare: other settings than the comparison resumed", lambda f: ["compare", "--out", str(f.tmp / "earlier-compare")], "other settings (steps 7 -> 16", 1),
    ("eval: no model", lambda f: _eval(f, "--model", f.missing), "--model", 2),
    ("eval: no questions", lambda f: _eval(f, "--questions", f.missing), "--questions", 2),
    ("eval: questions not JSONL", lambda f: _eval(f, "--questions", f.tmp / "garbage.jsonl"), "no usable rows (line 1: not valid JSON", 2),
    ("eval: no corpus", lambda f: _eval(f, "--corpus", f.missing), "--corpus", 2),
    ("eval: a date in another ISO form", lambda f: _eval(f, "--date", "20250601"), "'20250601' is not a date as YYYY-MM-DD", 2),
    ("teacher probe: a deadband edge that is not a number", lambda f: ["teacher", "probe", "--model", str(f.ckpt), "--data", str(f.tmp / "chat.jsonl"), "--eps-pos", "nan"], "nan is not 0 or more", 2),
    ("eval: a date that is not one", lambda f: _eval(f, "--date", "yesterday"), "'yesterday' is not a date as YYYY-MM-DD", 2),
    ("eval: a report over a directory", lambda f: _eval(f, "--out", f.tmp), "is a directory; give a file name", 2),
    ("teacher check: a viewer under a file", lambda f: _teacher(f, "--viewer", f.tmp / "chat.jsonl" / "v.html"), "chat.jsonl is a file", 2),
    ("eval: a corpus that is a question file", lambda f: _eval(f, "--corpus", f.tmp / "questions.jsonl"), "no usable rows", 2),
    ("teacher check: a corpus not JSONL", lambda f: _teacher(f, "--corpus", f.tmp / "garbage.jsonl"), "no usable rows (line 1: not valid JSON", 2),
    ("eval: tool gateway not there", lambda f: _eval(f, "--corpus", None, "--tools-url", f.closed), "cannot reach", 1),
    ("eval: compare to no report", lambda f: _eval(f, "--compare-to", f.missing), "--compare-to", 2),
    ("eval: compare to not JSON", lambda f: _eval(f, "--compare-to", f.tmp / "not-yaml.yaml"), "not a JSON report", 2),
    ("eval: compare to not a report", lambda f: _eval(f, "--compare-to", f.tmp / "not-a-report.json"), "not a report of an evaluation", 2),
    ("teacher check: no model", lambda f: _teacher(f, "--model", f.missing), "--model", 2),
    ("teacher check: questions not JSONL", lambda f: _teacher(f, "--questions", f.tmp / "garbage.jsonl"), "no usable rows (line 1: not valid JSON", 2),
    ("teacher check: no corpus", lambda f: _teacher(f, "--corpus", f.missing), "--corpus", 2),
    ("teacher check: a bad deadband", lambda f: _teacher(f, "--eps-pos", "-1"), "--eps-pos", 2),
    ("teacher check: a bad template", lambda f: _teacher(f, "--teacher-template", "{question} {hint}"), "teacher_template", 2),
    ("teacher probe: no data", lambda f: ["teacher", "probe", "--model", str(f.ckpt), "--data", str(f.missing)], "does not exist", 2),
    ("teacher probe: no answers", lambda f: ["teacher", "probe", "--model", str(f.ckpt), "--data", str(f.tmp / "chat.jsonl")], "line 1 is not a conversation with its answer", 2),
    ("teacher probe: a bad template", lambda f: ["teacher", "probe", "--model", str(f.ckpt), "--data", str(f.tmp / "chat.jsonl"), "--teacher-template", "{question} {hint}"], "teacher_template", 2),
    ("teacher teach: no answers", lambda f: ["teacher", "teach", "--model", str(f.ckpt), "--data", str(f.tmp / "chat.jsonl"), "--out", str(f.tmp / "taught")], "line 1 is not a conversation with its answer", 2),
    ("teacher teach: a bad template", lambda f: ["teacher", "teach", "--model", str(f.ckpt), "--data", str(f.tmp / "chat.jsonl"), "--out", str(f.tmp / "taught"), "--teacher-template", "{question} {hint}"], "teacher_template", 2),
    ("teacher teach: train layers of a model not grown", lambda f: [*_teach(f), "--train-layers", "grown"], "was not made by `pbsd model grow`", 2),
    ("teacher teach: train layers it lacks", lambda f: [*_teach(f), "--train-layers", "1,5"], "has layers 0..1", 2),
    ("teacher teach: train layers not numbers", lambda f: [*_teach(f), "--train-layers", "top"], "indices such as 2,3, or grown", 2),
    ("teacher teach: hops from a note without facts", lambda f: [*_teach(f), "--hops", "1", "--hops-from", "note"], "Invalid value for --hops-from", 2),
    ("model grow: no model", lambda f: ["model", "grow", "--model", str(f.missing), "--out", str(f.tmp / "grown")], "--model", 2),
    ("teacher drift: a cut-off step file", lambda f: ["teacher", "drift", "--model", str(f.ckpt), "--groups", str(f.tmp / "cut-groups")], "step-000001.msgpack: not a step's saved scored groups", 1),
    ("teacher tally: a cut-off step file", lambda f: ["teacher", "tally", "--model", str(f.ckpt), "--groups", str(f.tmp / "cut-groups")], "step-000001.msgpack: not a step's saved scored groups", 1),
    ("teacher tally: nothing to tally", lambda f: ["teacher", "tally", "--model", str(f.ckpt)], "nothing to tally", 2),
    ("teacher tally: a file for a comparison", lambda f: ["teacher", "tally", "--model", str(f.ckpt), "--compare", str(f.tmp / "chat.jsonl"), "--variant", "pbsd"], "is not a `pbsd compare` folder", 2),
    ("teacher drift: no groups folder", lambda f: ["teacher", "drift", "--model", str(f.ckpt), "--groups", str(f.missing)], "does not exist", 2),
    ("teacher drift: no scored groups", lambda f: ["teacher", "drift", "--model", str(f.ckpt), "--groups", str(f.tmp)], "no scored PBSD groups", 2),
    ("teacher tally: no groups folder", lambda f: ["teacher", "tally", "--model", str(f.ckpt), "--groups", str(f.missing)], "does not exist", 2),
    ("teacher tally: no scored groups", lambda f: ["teacher", "tally", "--model", str(f.ckpt), "--groups", str(f.tmp)], "no scored PBSD groups", 2),
    ("teacher check: support without facts", lambda f: _teacher(f, "--teacher-template", "support"), "3 of 3 questions", 1),
    # options out of their range, refused before anything runs: concurrency 0 waited for good, samples 0
    # divided by zero, a negative limit meant "all but the last N", a port past 65535 wrapped around
    ("eval: no trajectory in flight", lambda f: _eval(f, "--concurrency", "0"), "--concurrency", 2),
    ("eval: no samples", lambda f: _eval(f, "--samples", "0"), "--samples", 2),
    ("eval: top-p past 1", lambda f: _eval(f, "--top-p", "2"), "2.0 is not in (0, 1]", 2),
    ("eval: a negative temperature", lambda f: _eval(f, "--temperature", "-1"), "-1.0 is not above 0", 2),
    ("teacher check: no trajectory in flight", lambda f: _teacher(f, "--concurrency", "0"), "--concurrency", 2),
    ("world build: a negative split", lambda f: ["world", "build", "--out", str(f.missing), "--rl", "-5"], "--rl", 2),
    ("world sft-data: a negative limit", lambda f: ["world", "sft-data", "--world", str(f.world), "--out", str(f.missing), "--limit", "-3"], "--limit", 2),
    ("world sft-data: a rate past 1", lambda f: ["world", "sft-data", "--world", str(f.world), "--out", str(f.missing), "--detour-rate", "5"], "--detour-rate", 2),
    ("sft: no batch", lambda f: ["sft", "--data", str(f.tmp / "chat.jsonl"), "--model", str(f.ckpt), "--out", str(f.missing), "--batch-size", "0"], "--batch-size", 2),
    ("serve tools: a port past 65535", lambda f: ["serve", "tools", "--port", "99999"], "--port", 2),
    ("world demo-questions: a negative count", lambda f: ["world", "demo-questions", "--world", str(f.world), "--out", str(f.missing), "--config", str(f.tmp / "negative.yaml")], "eval_questions: Input should be greater than 0", 1),
    ("compare: no evaluation samples", lambda f: ["compare", "--out", str(f.missing), "--eval-samples", "0"], "--eval-samples", 2),
    # refused before the model is loaded (f.ckpt would fail to load) or anything sampled
    ("eval: compare to other questions", lambda f: _eval(f, "--compare-to", f.tmp / "other-report.json"), "3 of the 3 evaluated here are not among its 1", 2),
]  # fmt: skip


def _serve_case(service: str, variable: str, value: str, says: str):
    return (f"serve {service}: {variable}", service, {variable: value}, says)


SERVE_CASES = [
    _serve_case("tools", "PBSD_TOOLS_CORPUS", "/no/such/corpus.jsonl", "PBSD_TOOLS_CORPUS: /no/such/corpus.jsonl is not a file"),
    _serve_case("rollout", "PBSD_ROLLOUT_MODEL", "/no/such/checkpoint", "PBSD_ROLLOUT_MODEL: no checkpoint directory"),
    _serve_case("scorer", "PBSD_SCORER_MODEL", "runs/no/such/policy", "PBSD_SCORER_MODEL: no checkpoint directory"),
    _serve_case("trainer", "PBSD_TRAINER_PORT", "eighty", "PBSD_TRAINER_PORT: Input should be a valid integer"),
]  # fmt: skip


def _one_line_error(result, says: str, code: int) -> None:
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), (
        result.output
    )
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_user_error_is_one_line(case, f):
    _, args, says, code = case
    _one_line_error(runner.invoke(app, args(f)), says, code)


@pytest.mark.parametrize("case", SERVE_CASES, ids=[c[0] for c in SERVE_CASES])
def test_a_service_with_a_bad_path_says_which_variable(case, monkeypatch):
    _, service, env, says = case
    monkeypatch.setenv("PBSD_TRAINER_LOCAL_MODE", "1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _one_line_error(runner.invoke(app, ["serve", service]), says, 2)


def test_the_tool_gateway_refuses_a_corpus_with_no_document_in_a_line(monkeypatch, tmp_path):
    """The loader's traceback under "Application startup failed" was how a malformed corpus showed."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"url": 1}\nnot json\n')
    monkeypatch.setenv("PBSD_TOOLS_BACKEND", "offline")
    monkeypatch.setenv("PBSD_TOOLS_CORPUS", str(corpus))
    _one_line_error(
        runner.invoke(app, ["serve", "tools"]), "PBSD_TOOLS_CORPUS: " + f"{corpus}: no usable rows", 2
    )


@pytest.mark.parametrize("via", ["--host", "PBSD_TRAINER_HOST"])
def test_a_bind_address_no_resolver_knows_is_named_where_it_came_from(via, monkeypatch):
    """uvicorn said only "[Errno -2] Name or service not known" and exited 3."""
    monkeypatch.setenv("PBSD_TRAINER_LOCAL_MODE", "1")
    args = ["serve", "trainer"]
    if via == "--host":
        args += ["--host", "no-such-host.invalid"]
    else:
        monkeypatch.setenv(via, "no-such-host.invalid")
    _one_line_error(
        runner.invoke(app, args), f"Invalid value for {via}: cannot bind to 'no-such-host.invalid'", 2
    )


def test_a_trainer_that_does_not_answer_in_time(monkeypatch):
    """A listening socket that never accepts: the connection opens, no answer comes."""
    import pbsd.cli.runs

    monkeypatch.setattr(pbsd.cli.runs, "_TIMEOUT_S", 0.3)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        result = runner.invoke(app, ["runs", "list", "--url", url])
    _one_line_error(result, f"no trainer at {url}: no answer in time", 1)


def _leaves(group, prefix: str = ""):
    for name, command in group.commands.items():
        if hasattr(command, "commands"):  # a group
            yield from _leaves(command, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}"


def test_every_command_has_a_case():
    covered = {case[0].split(":")[0] for case in CASES + SERVE_CASES} | NOTHING_TO_GET_WRONG
    missing = set(_leaves(typer.main.get_command(app))) - covered
    assert not missing, f"commands with no user-error case in this file: {sorted(missing)}"


def test_every_help_line_is_a_whole_sentence_within_the_width():
    """The command lists (`pbsd --help`, `pbsd world --help`, ...) show each command's first
    paragraph, which click cuts to the width left beside the longest name (80 columns)."""

    def check(group, path: str) -> None:
        limit = 80 - 6 - max(len(name) for name in group.commands)
        for name, command in group.commands.items():
            first = " ".join((command.help or "").split("\n\n")[0].split())
            assert first.endswith("."), f"{path} {name}: {first!r}"
            assert command.get_short_help_str(limit) == first, f"{path} {name}: longer than {limit}"
            if hasattr(command, "commands"):
                check(command, f"{path} {name}")

    check(typer.main.get_command(app), "pbsd")


def test_the_installed_command_prints_no_traceback(tmp_path):
    """The real entry point, as a user runs it: typer's handler for uncaught errors never fires."""
    pbsd = shutil.which("pbsd", path=str(Path(sys.executable).parent)) or shutil.which("pbsd")
    assert pbsd is not None, "the pbsd command is not installed (make bootstrap)"
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PBSD_")}
    done = subprocess.run(
        [pbsd, "runs", "list", "--url", url], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 1 and done.stdout == "", done
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: no trainer at {url}: connection failed") and "PBSD_TRAINER_URL" in line


def test_worlds_of_one_seed_and_size_share_their_corpus(f):
    """Their splits may differ; the questions of one are answered from the other's corpus."""
    from pbsd.cli.inputs import same_world

    split = f.tmp / "resplit-world"
    shutil.copytree(f.world, split)
    manifest = json.loads((split / "manifest.json").read_text())
    manifest["files"]["questions/rl.jsonl"] = "1" * 64  # other splits, the same corpus
    (split / "manifest.json").write_text(json.dumps(manifest))
    same_world(f.world / "questions" / "rl.jsonl", split / "corpus.jsonl")
    with pytest.raises(typer.BadParameter, match="no answer would be found in it"):
        same_world(f.world / "questions" / "rl.jsonl", f.tmp / "other-world" / "corpus.jsonl")
