"""The committed warm policy, the commands in its RECIPE.md and the defaults `pbsd demo --from-scratch`
uses all say the same thing: a recipe that drifted from the asset would no longer be "the exact
command and seed that made it"."""

from __future__ import annotations

import json
import re
import shlex

from demo.config import ASSETS, DemoConfig


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

    meta = json.loads((ASSETS / "pbsd.json").read_text())
    made_with = meta["sft"]["config"]
    recipe = {
        "epochs": int(sft["--epochs"]),
        "lr": float(sft["--lr"]),
        "batch_size": int(sft["--batch-size"]),
        "warmup_steps": int(sft["--warmup-steps"]),
        "seed": 0,  # the recipe passes no --seed: every command's default is 0
    }
    demo = {
        "epochs": c.sft_epochs,
        "lr": c.sft_lr,
        "batch_size": c.sft_batch_size,
        "warmup_steps": c.sft_warmup_steps,
        "seed": c.seed,
    }
    assert {k: made_with[k] for k in recipe} == recipe == demo
    model = json.loads((ASSETS / "config.json").read_text())
    assert (model["vocab_size"], model["hidden_size"]) == (c.vocab_size, c.hidden_size)
