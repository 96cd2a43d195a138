"""The committed warm policy, the commands in its RECIPE.md and the defaults `pbsd demo --from-scratch`
uses all say the same thing: a recipe that drifted from the asset would no longer be "the exact
command and seed that made it"."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict

from demo.config import ASSETS, DemoConfig
from proto.runs import PbsdSpec
from services.trainer.note_pass import NotePassConfig
from services.trainer.sft import SftConfig


def recipe_commands() -> list[tuple[str, dict[str, str | bool]]]:
    """The recipe's `pbsd ...` lines in order, as ("world build", {"--out": "world", ...}); a flag
    with no value (``--entity-tokens``) maps to True."""
    block = re.search(r"```bash\n(.*?)```", (ASSETS / "RECIPE.md").read_text(), re.S).group(1)
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        assert words[0] == "pbsd", line
        first_flag = next(i for i, w in enumerate(words) if w.startswith("--"))
        flags, parsed = words[first_flag:], {}
        while flags:
            assert flags[0].startswith("--"), line
            if len(flags) > 1 and not flags[1].startswith("--"):
                parsed[flags[0]], flags = flags[1], flags[2:]
            else:
                parsed[flags[0]], flags = True, flags[1:]
        commands.append((" ".join(words[1:first_flag]), parsed))
    return commands


def sft_config(flags: dict) -> SftConfig:
    """What `pbsd sft` runs with these flags (the recipe passes no --seed: every command's default is 0)."""
    return SftConfig(
        epochs=int(flags["--epochs"]),
        lr=float(flags["--lr"]),
        batch_size=int(flags["--batch-size"]),
        warmup_steps=int(flags["--warmup-steps"]),
        save_every_epoch=flags.get("--save-every-epoch", False),
        limit=int(flags["--limit"]) if "--limit" in flags else None,
    )


def assert_recorded(recorded: dict, recipe: SftConfig) -> None:
    """Every setting, defaults included: a changed default would make the recipe another recipe (a
    setting added since the pass ran is recorded only by later ones, at its default)."""
    as_json = json.loads(json.dumps(asdict(recipe)))  # tuples recorded as lists
    assert recorded["config"] == {k: v for k, v in as_json.items() if k in recorded["config"]}
    assert {k: v for k, v in asdict(recipe).items() if k not in recorded["config"]} == {
        k: v for k, v in asdict(SftConfig()).items() if k not in recorded["config"]
    }
    assert recorded["libraries"].keys() == {"torch", "transformers", "tokenizers"}


def test_recipe_asset_and_demo_defaults_agree():
    c = DemoConfig()
    commands = recipe_commands()
    assert [name for name, _ in commands] == [
        "world build",
        "world sft-data",
        "world sft-data",
        "model tiny",
        "sft",
        "sft",
        "teacher teach",
        "world fingerprint",
    ]
    build, data, boxed_data, tiny, sft, boxed, teach, stamp = (flags for _, flags in commands)
    assert int(build["--sft"]) == c.n_sft
    assert int(data["--search-num"]) == int(boxed_data["--search-num"]) == c.sft_search_num
    assert data.get("--final", "restate") == c.sft_final and boxed_data["--final"] == "boxed"
    # every command feeds the next, and the last stamps what the note pass wrote
    assert data["--world"] == boxed_data["--world"] == tiny["--world"] == build["--out"]
    assert sft["--data"] == data["--out"] == tiny["--sft-data"] and sft["--model"] == tiny["--out"]
    assert boxed["--data"] == teach["--data"] == boxed_data["--out"] and boxed["--model"] == sft["--out"]
    assert teach["--model"] == boxed["--out"]
    assert stamp["--stamp"] == teach["--out"] == ASSETS.name

    meta = json.loads((ASSETS / "pbsd.json").read_text())
    # `pbsd sft` keeps the record of the checkpoint it started from as sft_before
    assert_recorded(meta["sft_before"], sft_config(sft))
    # the demo's rebuild writes no epoch checkpoints, which changes nothing in the result
    assert {**asdict(sft_config(sft)), "save_every_epoch": False} == asdict(c.sft_config())
    assert_recorded(meta["sft"], sft_config(boxed))
    assert sft_config(boxed) == c.boxed_pass_config()

    # the note pass: the recipe's flags over NotePassConfig's defaults, as recorded and as the demo runs it
    note = NotePassConfig(
        steps=int(teach["--steps"]),
        lr=float(teach["--lr"]),
        consistency=float(teach["--consistency"]),
        doubt=float(teach.get("--doubt", 0.0)),
        same_final=teach.get("--same-final", False),
    )  # the default template is the demo's teacher, answer-first
    assert note.template == PbsdSpec(teacher_template=c.teacher_template).teacher_template
    # a record made before an option existed holds that option's default
    defaults = json.loads(json.dumps(asdict(NotePassConfig())))
    assert json.loads(json.dumps(asdict(note))) == defaults | meta["note_pass"]["config"]
    assert note == c.note_pass_config()
    model = json.loads((ASSETS / "config.json").read_text())
    spec = model["pbsd_tiny_spec"]  # vocab_size there is BPE's; the entity tokens come on top
    assert (spec["vocab_size"], model["hidden_size"]) == (c.vocab_size, c.hidden_size)
    assert model["tie_word_embeddings"] == c.copy_heads
    assert model["num_key_value_heads"] == int(tiny.get("--kv-heads", 2)) == c.kv_heads
    for flag in ("entity_tokens", "copy_heads"):
        made_with = model["pbsd_tiny_spec"].get(flag, False)
        assert made_with == tiny.get("--" + flag.replace("_", "-"), False) == getattr(c, flag)


def test_the_committed_policy_stands_in_only_for_its_own_recipe():
    """A demo whose warm-start settings differ from the asset's builds its own policy instead of
    silently using the committed one (the settings would be accepted and ignored)."""
    from demo.warm_start import committed_policy_misfit

    world = json.loads((ASSETS / "pbsd.json").read_text())["world_sha256"]
    assert committed_policy_misfit(DemoConfig(), world) is None
    # RL and evaluation settings do not touch the warm start
    assert committed_policy_misfit(DemoConfig(steps=3, lr=1e-5, eval_questions=4), world) is None
    assert committed_policy_misfit(DemoConfig(), "0" * 64) == "was made from another world"
    misfit = committed_policy_misfit(DemoConfig(sft_epochs=3, copy_heads=False), world)
    assert misfit == "was made with other warm-start settings (copy_heads True -> False, sft_epochs 2 -> 3)"
    misfit = committed_policy_misfit(DemoConfig(sft_final="boxed", boxed_pass_conversations=0), world)
    assert misfit == (
        "was made with other warm-start settings (sft_final restate -> boxed, boxed_pass_conversations 1600 -> 0)"
    )
