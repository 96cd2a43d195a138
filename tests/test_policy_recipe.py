"""The committed warm policy, the commands in its RECIPE.md and the defaults `pbsd demo --from-scratch`
uses all say the same thing: a recipe that drifted from the asset would no longer be "the exact
command and seed that made it"."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict

from demo.config import ASSETS, DemoConfig
from services.trainer.sft import SftConfig


def recipe_commands() -> dict[str, dict[str, str | bool]]:
    """The recipe's `pbsd ...` lines as {"world build": {"--out": "world", ...}, "sft": {...}}; a
    flag with no value (``--entity-tokens``) maps to True."""
    block = re.search(r"```bash\n(.*?)```", (ASSETS / "RECIPE.md").read_text(), re.S).group(1)
    commands = {}
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
        commands[" ".join(words[1:first_flag])] = parsed
    return commands


def test_recipe_asset_and_demo_defaults_agree():
    c = DemoConfig()
    commands = recipe_commands()
    assert list(commands) == ["world build", "world sft-data", "model tiny", "sft", "world fingerprint"]
    assert int(commands["world build"]["--sft"]) == c.n_sft
    assert int(commands["world sft-data"]["--search-num"]) == c.sft_search_num
    sft = commands["sft"]
    # every command feeds the next, and the last stamps what `pbsd sft` wrote
    assert commands["world sft-data"]["--world"] == commands["model tiny"]["--world"] == "world"
    assert sft["--data"] == commands["world sft-data"]["--out"] == commands["model tiny"]["--sft-data"]
    assert sft["--model"] == commands["model tiny"]["--out"]
    assert commands["world fingerprint"]["--stamp"] == sft["--out"] == ASSETS.name

    recipe = SftConfig(
        epochs=int(sft["--epochs"]),
        lr=float(sft["--lr"]),
        batch_size=int(sft["--batch-size"]),
        warmup_steps=int(sft["--warmup-steps"]),
        save_every_epoch=sft.get("--save-every-epoch", False),
    )  # the recipe passes no --seed: every command's default is 0
    demo = c.sft_config()
    meta = json.loads((ASSETS / "pbsd.json").read_text())
    # every setting, defaults included: a changed default would make the recipe another recipe (a
    # setting added since the asset was made is recorded only by later ones, at its default)
    recorded = meta["sft"]["config"]
    assert recorded == {k: v for k, v in asdict(recipe).items() if k in recorded}
    assert {k: v for k, v in asdict(recipe).items() if k not in recorded} == {
        k: v for k, v in asdict(SftConfig()).items() if k not in recorded
    }
    # the demo's rebuild writes no epoch checkpoints, which changes nothing in the result
    assert {**asdict(recipe), "save_every_epoch": False} == asdict(demo)
    assert meta["sft"]["libraries"].keys() == {"torch", "transformers", "tokenizers"}
    model = json.loads((ASSETS / "config.json").read_text())
    spec = model["pbsd_tiny_spec"]  # vocab_size there is BPE's; the entity tokens come on top
    assert (spec["vocab_size"], model["hidden_size"]) == (c.vocab_size, c.hidden_size)
    assert model["tie_word_embeddings"] == c.copy_heads
    assert model["num_key_value_heads"] == int(commands["model tiny"].get("--kv-heads", 2)) == c.kv_heads
    for flag in ("entity_tokens", "copy_heads"):
        made_with = model["pbsd_tiny_spec"].get(flag, False)
        assert (
            made_with == commands["model tiny"].get("--" + flag.replace("_", "-"), False) == getattr(c, flag)
        )


def test_the_committed_policy_stands_in_only_for_its_own_recipe():
    """A demo whose warm-start settings differ from the asset's builds its own policy instead of
    silently using the committed one (the settings would be accepted and ignored)."""
    from demo.run import committed_policy_misfit

    world = json.loads((ASSETS / "pbsd.json").read_text())["world_sha256"]
    assert committed_policy_misfit(DemoConfig(), world) is None
    # RL and evaluation settings do not touch the warm start
    assert committed_policy_misfit(DemoConfig(steps=3, lr=1e-5, eval_questions=4), world) is None
    assert committed_policy_misfit(DemoConfig(), "0" * 64) == "was made from another world"
    misfit = committed_policy_misfit(DemoConfig(sft_epochs=3, copy_heads=False), world)
    assert misfit == "was made with other warm-start settings (copy_heads True -> False, sft_epochs 2 -> 3)"
    misfit = committed_policy_misfit(DemoConfig(sft_final="boxed"), world)
    assert misfit == "was made with other warm-start settings (sft_final restate -> boxed)"
