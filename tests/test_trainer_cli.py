"""The command line around the trainer: runs submit/list/show/cancel, model tiny, sft (runs watch:
test_runs_watch.py)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import yaml
from typer.testing import CliRunner

from pbsd.cli import app
from tests.conftest import TOKEN
from tests.test_trainer_service import _spec

runner = CliRunner()


async def _add_eval_round(redis_url: str, prefix: str, run_id: str) -> None:
    import redis.asyncio as aioredis

    from services.trainer.runs import RunStore

    client = aioredis.from_url(redis_url)
    accuracy = {"all": {"questions": 8, "mean@4": 0.25, "pass@k": {"1": 0.25, "4": 0.5}}}
    record = {"version": 3, "step": 3, "samples": 4, "questions": 8, "accuracy": accuracy}
    await RunStore(client, prefix).add_metrics(run_id, record, series="evals")
    await client.aclose()


def test_runs_commands_against_the_api(api, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path):
    spec_file = tmp_path / "run.yaml"
    spec = _spec(tiny_world, tiny_checkpoint)
    spec["trainer"]["max_steps"] = 100
    # YAML reads an unquoted date as a date, which the request's JSON could not hold: sent as its text
    spec_file.write_text(yaml.safe_dump(spec).replace("name: t\n", "name: 2020-01-01\n"))
    args = ["--url", api, "--token", TOKEN]
    submitted = runner.invoke(app, ["runs", "submit", str(spec_file), *args])
    assert submitted.exit_code == 0, submitted.output
    run_id = submitted.stdout.strip()
    listed = runner.invoke(app, ["runs", "list", *args])
    assert run_id in listed.output
    assert runner.invoke(app, ["runs", "list", "--limit", "1", *args]).output.count("\n") == 1
    shown = json.loads(
        runner.invoke(app, ["runs", "show", run_id, *args]).stdout
    )  # the trainer logs on stderr
    assert shown["id"] == run_id and shown["spec"]["trainer"]["prompts_per_step"] == 2
    assert shown["spec"]["name"] == "2020-01-01"
    none = runner.invoke(app, ["runs", "evals", run_id, *args])
    assert none.exit_code == 0 and "no validation round recorded yet" in none.output
    asyncio.run(_add_eval_round(redis_url, key_prefix, run_id))
    rounds = runner.invoke(app, ["runs", "evals", run_id, *args])
    assert "v3     step     3  mean@4 0.250  pass@4 0.500  on 8 questions" in rounds.output, rounds.output
    cancelled = runner.invoke(app, ["runs", "cancel", run_id, *args])
    assert cancelled.exit_code == 0 and run_id in cancelled.output
    deadline = time.monotonic() + 60  # a run the executor had started stops after its step
    while json.loads(runner.invoke(app, ["runs", "show", run_id, *args]).stdout)["state"] != "cancelled":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    again = runner.invoke(app, ["runs", "cancel", run_id, *args])
    assert again.exit_code == 1 and "409" in again.output and "already cancelled" in again.output
    deleted = runner.invoke(app, ["runs", "delete", run_id, "--files", *args])
    assert deleted.exit_code == 0 and f"{run_id} deleted" in deleted.output, deleted.output
    assert run_id not in runner.invoke(app, ["runs", "list", *args]).output
    denied = runner.invoke(app, ["runs", "list", "--url", api, "--token", "wrong"])
    assert (
        denied.exit_code == 1
        and "401" in denied.output
        and "--token or PBSD_TRAINER_API_TOKEN" in denied.output
    )
    no_token = runner.invoke(app, ["runs", "list", "--url", api], env={"PBSD_TRAINER_API_TOKEN": None})
    [said] = [line for line in no_token.stderr.splitlines() if line.startswith("error:")]  # and no traceback
    assert no_token.exit_code == 1 and "401" in said and "--token or PBSD_TRAINER_API_TOKEN" in said
    spec["rollout"]["group_size"] = 0
    spec_file.write_text(yaml.safe_dump(spec))
    invalid = runner.invoke(app, ["runs", "submit", str(spec_file), *args])
    assert invalid.exit_code == 1 and "rollout.group_size" in invalid.output


def test_model_tiny_and_sft(tiny_world, tmp_path):
    from worldgen.oracle import write_sft_data

    data = tmp_path / "sft.jsonl"
    write_sft_data(tiny_world, data, limit=12)
    made = runner.invoke(
        app,
        [
            "model",
            "tiny",
            "--world",
            str(tiny_world),
            "--out",
            str(tmp_path / "tiny"),
            "--sft-data",
            str(data),
            "--vocab-size",
            "1024",
            "--hidden-size",
            "64",
        ],
    )
    assert made.exit_code == 0, made.output
    tuned = runner.invoke(
        app,
        [
            "sft",
            "--data",
            str(data),
            "--model",
            str(tmp_path / "tiny"),
            "--out",
            str(tmp_path / "sft"),
            "--epochs",
            "3",
            "--lr",
            "3e-3",
            "--batch-size",
            "4",
            "--warmup-steps",
            "1",
        ],
    )
    assert tuned.exit_code == 0, tuned.output
    history = [json.loads(x) for x in (tmp_path / "sft" / "sft_history.jsonl").read_text().splitlines()]
    assert len(history) == 9 and history[-1]["loss"] < history[0]["loss"]  # it learns the format
    assert (tmp_path / "sft" / "config.json").exists() and (tmp_path / "sft" / "tokenizer.json").exists()
    # both checkpoints say which library versions made them (a rebuild is compared like for like)
    import tokenizers

    built = json.loads((tmp_path / "tiny" / "pbsd.json").read_text())["libraries"]
    tuned_with = json.loads((tmp_path / "sft" / "pbsd.json").read_text())["sft"]["libraries"]
    assert built == tuned_with and built["tokenizers"] == tokenizers.__version__ and "torch" in built
    # and which text: the SFT data's digest, and the tokenizer's training text's (a rebuild on
    # another machine can see other BPE rankings in the oracle's searches)
    import hashlib

    sft_meta = json.loads((tmp_path / "sft" / "pbsd.json").read_text())["sft"]
    assert sft_meta["data_sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    digest = json.loads((tmp_path / "tiny" / "pbsd.json").read_text())["tokenizer_text_sha256"]
    assert len(digest) == 64 and digest != sft_meta["data_sha256"]
    # the recipe's last step ties the tuned policy to its world, as `pbsd demo --from-scratch` does
    from worldgen.build import world_fingerprint

    stamped = runner.invoke(
        app, ["world", "fingerprint", "--world", str(tiny_world), "--stamp", str(tmp_path / "sft")]
    )
    assert stamped.exit_code == 0, stamped.output
    fingerprint = world_fingerprint(json.loads((tiny_world / "manifest.json").read_text()))
    meta = json.loads((tmp_path / "sft" / "pbsd.json").read_text())
    assert stamped.output.strip() == meta["world_sha256"] == fingerprint and meta["sft"]["libraries"] == built
    not_a_world = runner.invoke(app, ["world", "fingerprint", "--world", str(tmp_path / "sft")])
    assert not_a_world.exit_code == 2 and "not a world" in not_a_world.output


def test_sft_also_learns_conversations_in_the_teachers_format(tiny_world, tiny_checkpoint, tmp_path):
    """``--teacher-format NAME:FRACTION``: that share of the conversations is learned a second time
    after x*; which ones is the seed's choice, and ``--limit`` takes the first conversations."""
    from agent.chat import ChatTokenizer
    from proto.templates import DEFAULT_TEACHER_TEMPLATE, SUPPORT_TEACHER_TEMPLATE
    from services.trainer.sft import SftConfig, lay_out
    from worldgen.oracle import write_sft_data

    data = tmp_path / "sft.jsonl"
    write_sft_data(tiny_world, data, limit=10)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    formats = ((DEFAULT_TEACHER_TEMPLATE, 1.0), (SUPPORT_TEACHER_TEMPLATE, 0.5))
    samples, skipped, (answer, support) = lay_out(tok, rows, SftConfig(teacher_formats=formats))
    assert answer == len(rows) and 0 < support < len(rows) and skipped == 0  # all, then about half
    assert len(samples) == len(rows) + answer + support
    assert {s.trajectory_id for s in samples} >= {f"{rows[0]['id']}/x*0", rows[0]["id"]}
    again = lay_out(tok, rows, SftConfig(teacher_formats=formats))[0]
    assert [s.trajectory_id for s in again] == [s.trajectory_id for s in samples]  # seeded
    other = lay_out(tok, rows, SftConfig(teacher_formats=formats, seed=1))[0]
    assert [s.trajectory_id for s in other] != [s.trajectory_id for s in samples]

    base = ["sft", "--data", str(data), "--model", str(tiny_checkpoint), "--out", str(tmp_path / "tuned")]
    done = runner.invoke(
        app,
        [
            *base,
            "--teacher-format",
            "support",
            "--teacher-contradict",
            "1",
            "--limit",
            "2",
            "--batch-size",
            "4",
        ],
    )
    assert done.exit_code == 0, done.output
    stats = json.loads((tmp_path / "tuned" / "pbsd.json").read_text())["sft"]
    assert stats["conversations"] == 4 and stats["teacher_format_conversations"] == [2]
    bad = runner.invoke(app, [*base, "--teacher-format", "hint:0.5"])
    assert bad.exit_code == 2 and "answer" in bad.output and "support" in bad.output


def test_sft_token_layout_matches_the_rollouts(tiny_checkpoint):
    from agent.chat import ChatTokenizer
    from services.trainer.sft import encode_conversation

    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "call"},
        {"role": "user", "content": "result"},
        {"role": "assistant", "content": "\\boxed{A}"},
    ]
    ids, mask = encode_conversation(tok, messages)
    call, glue, answer = (
        tok.encode("call") + [tok.end_id],
        tok.glue_ids("result", closed=True),
        tok.encode("\\boxed{A}") + [tok.end_id],
    )
    prompt = tok.prompt_ids("S", "Q")
    assert ids == prompt + call + glue + answer  # the same ids a rollout of this conversation has
    assert mask == [0] * len(prompt) + [1] * len(call) + [0] * len(glue) + [1] * len(answer)
    # loss_on="turns" learns the tool results too (same ids), never the system prompt and question.
    ids_turns, mask_turns = encode_conversation(tok, messages, "turns")
    assert ids_turns == ids
    assert mask_turns == [0] * len(prompt) + [1] * (len(call) + len(glue) + len(answer))


def test_sft_config_rejects_unknown_choices():
    from services.trainer.sft import SftConfig

    assert SftConfig(loss_on="turns").loss_on == "turns"
    with pytest.raises(ValueError, match="loss_on"):
        SftConfig(loss_on="tools")
    with pytest.raises(ValueError, match="lr_decay"):
        SftConfig(lr_decay="linear")


@pytest.mark.parametrize("option", [["--loss-on", "tools"], ["--lr-decay", "linear"]])
def test_sft_command_reports_a_bad_choice_as_a_usage_error(option, tmp_path, checkpoint_stub):
    # before the model is loaded: the checkpoint need only look like one
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hello"}]}\n')
    checkpoint_stub(tmp_path)
    args = [
        "sft",
        "--data",
        str(tmp_path / "chat.jsonl"),
        "--model",
        str(tmp_path),
        "--out",
        str(tmp_path / "o"),
    ]
    result = runner.invoke(app, [*args, *option])
    assert result.exit_code == 2, result.output
    assert (
        option[0].removeprefix("--").replace("-", "_") in result.output and "Traceback" not in result.output
    )


def test_a_trainer_without_a_token_serves_on_loopback_only(monkeypatch):
    monkeypatch.delenv("PBSD_TRAINER_API_TOKEN", raising=False)
    monkeypatch.setenv("PBSD_TRAINER_LOCAL_MODE", "1")
    refused = runner.invoke(app, ["serve", "trainer", "--host", "0.0.0.0"])
    assert refused.exit_code == 2 and "loopback only" in refused.output


def test_model_tiny_entity_tokens_make_every_name_and_address_one_token(tiny_world, tmp_path):
    from agent.chat import ChatTokenizer

    made = runner.invoke(
        app,
        ["model", "tiny", "--world", str(tiny_world), "--out", str(tmp_path / "tiny"), "--vocab-size", "1024"]
        + ["--hidden-size", "64", "--entity-tokens"],
    )
    assert made.exit_code == 0, made.output
    tokenizer = ChatTokenizer.from_pretrained(tmp_path / "tiny")  # as the agent and the trainer load it
    entities = [json.loads(x) for x in (tiny_world / "entities.jsonl").read_text().splitlines()]
    whole = {e["name"] for e in entities} | {f"kb://{e['id']}" for e in entities}
    assert len(tokenizer.tok) == 1024 + len(whole)
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer.tok) and config["pbsd_tiny_spec"]["entity_tokens"]
    for w in whole:
        # one token wherever it stands: after a space, in quotes, in a tool call's JSON
        assert len(tokenizer.encode(w)) == 1, w
        assert len(tokenizer.encode(f'{{"q": "{w}"}}')) == len(tokenizer.encode('{"q": "x"}')), w
    # and text decodes back byte for byte, the agent's and the scorer's round trip
    for doc in (tiny_world / "corpus.jsonl").read_text().splitlines()[:50]:
        text = json.loads(doc)["text"]
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_a_service_with_bad_settings_says_which_variable_in_one_line(monkeypatch):
    for key in (
        "PBSD_TRAINER_API_TOKEN",
        "PBSD_TRAINER_LOCAL_MODE",
        "PBSD_TOOLS_CORPUS",
        "PBSD_TOOLS_BACKEND",
    ):
        monkeypatch.delenv(key, raising=False)
    trainer = runner.invoke(app, ["serve", "trainer"])
    assert trainer.exit_code == 2 and "Traceback" not in trainer.output
    assert "error: set PBSD_TRAINER_API_TOKEN, or PBSD_TRAINER_LOCAL_MODE=1" in trainer.output
    monkeypatch.setenv("PBSD_TRAINER_LOCAL_MODE", "1")
    monkeypatch.setenv("PBSD_TRAINER_PORT", "eighty")
    port = runner.invoke(app, ["serve", "trainer"])
    assert port.exit_code == 2 and "error: PBSD_TRAINER_PORT: Input should be a valid integer" in port.output
    tools = runner.invoke(app, ["serve", "tools"])
    assert tools.exit_code == 2 and "PBSD_TOOLS_CORPUS" in tools.output
