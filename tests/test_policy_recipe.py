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


def recipe_commands() -> dict[str, dict[str, str]]:
    """The recipe's `pbsd ...` lines as {"world build": {"--out": "world", ...}, "sft": {...}}."""
    block = re.search(r"```bash\n(.*?)```", (ASSETS / "RECIPE.md").read_text(), re.S).group(1)
    commands = {}
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        assert words[0] == "pbsd", line
        first_flag = next(i for i, w in enumerate(words) if w.startswith("--"))
        flags = words[first_flag:]
        assert all(f.startswith("--") for f in flags[::2]) and len(flags) % 2 == 0, line
        commands[" ".join(words[1:first_flag])] = dict(zip(flags[::2], flags[1::2], strict=True))
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
    )  # the recipe passes no --seed: every command's default is 0
    demo = c.sft_config()
    meta = json.loads((ASSETS / "pbsd.json").read_text())
    # every setting, defaults included: a changed default would make the recipe another recipe
    assert meta["sft"]["config"] == asdict(recipe) == asdict(demo)
    assert meta["sft"]["libraries"].keys() == {"torch", "transformers", "tokenizers"}
    model = json.loads((ASSETS / "config.json").read_text())
    assert (model["vocab_size"], model["hidden_size"]) == (c.vocab_size, c.hidden_size)
    assert model["pbsd_tiny_spec"].get("entity_tokens", False) == c.entity_tokens


def test_the_committed_policy_stands_in_only_for_its_own_recipe():
    """A demo whose warm-start settings differ from the asset's builds its own policy instead of
    silently using the committed one (the settings would be accepted and ignored)."""
    from demo.run import committed_policy_misfit

    world = json.loads((ASSETS / "pbsd.json").read_text())["world_sha256"]
    assert committed_policy_misfit(DemoConfig(), world) is None
    # RL and evaluation settings do not touch the warm start
    assert committed_policy_misfit(DemoConfig(steps=3, lr=1e-5, eval_questions=4), world) is None
    assert committed_policy_misfit(DemoConfig(), "0" * 64) == "was made from another world"
    misfit = committed_policy_misfit(DemoConfig(sft_epochs=3, entity_tokens=True), world)
    assert (
        misfit == "was made with other warm-start settings (entity_tokens False -> True, sft_epochs 2 -> 3)"
    )
