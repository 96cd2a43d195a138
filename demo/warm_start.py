"""The demo's warm policy: the committed one when it fits the world and the settings, else built here.

``pbsd demo --from-scratch`` (and a world or settings the committed policy was not made for) runs
the steps of assets/demo-policy/RECIPE.md itself: oracle SFT data, a tokenizer and a tiny
Qwen3-MoE, supervised fine-tuning, then the optional passes after it, each from the one before.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from demo.config import ASSETS, DemoConfig
from demo.progress import say

__all__ = ["build_policy", "committed_policy_misfit", "prepare_policy"]


def prepare_policy(config: DemoConfig, world: Path, fingerprint: str, out: Path) -> Path:
    """The warmed-up policy: ``--policy``, or the committed one when it was made from this very world
    with these warm-start settings, else built here."""
    target = out / "policy-sft"
    if config.policy:
        say(f"using the given policy {config.policy}")
        shutil.copytree(config.policy, target, dirs_exist_ok=True)
        return target
    if not config.from_scratch:
        misfit = committed_policy_misfit(config, fingerprint)
        if misfit is None:
            say(
                f"using the committed warm policy ({ASSETS.relative_to(ASSETS.parent.parent)}; see RECIPE.md)"
            )
            shutil.copytree(ASSETS, target, dirs_exist_ok=True)
            return target
        # about 100 minutes on 2 cores; a user who wants the committed policy anyway passes it as --policy
        say(f"the committed policy {misfit}: building one from scratch (--policy {ASSETS} uses it as it is)")
    return build_policy(config, world, fingerprint, target)


def committed_policy_misfit(config: DemoConfig, fingerprint: str) -> str | None:
    """Why the committed policy cannot stand in for what ``config`` would build (None: it can)."""
    meta_file = ASSETS / "pbsd.json"
    if not meta_file.exists():
        return "is missing"
    if json.loads(meta_file.read_text()).get("world_sha256") != fingerprint:
        return "was made from another world"
    made_with = DemoConfig().warm_start()
    changed = {k: v for k, v in config.warm_start().items() if v != made_with[k]}
    if changed:
        return (
            "was made with other warm-start settings ("
            + ", ".join(f"{k} {made_with[k]} -> {v}" for k, v in changed.items())
            + ")"
        )
    return None


def build_policy(config: DemoConfig, world: Path, fingerprint: str, target: Path) -> Path:
    """Oracle SFT data, tokenizer and tiny model, SFT and the passes after it (``--from-scratch``)."""
    from services.model.checkpoint import stamp_world
    from services.model.tiny import TinySpec, init_tiny
    from services.trainer.note_pass import LOSSES, describe, run_note_pass
    from services.trainer.sft import progress_bar, run_sft
    from worldgen.oracle import write_sft_data

    work = target.parent / "warm-start"
    work.mkdir(parents=True, exist_ok=True)
    say("writing oracle trajectories for SFT")
    oracle = {"seed": config.seed, "search_num": config.sft_search_num, "rename": config.sft_rename}
    stats = write_sft_data(world, work / "sft.jsonl", final=config.sft_final, **oracle)
    say(f"{stats['written']} trajectories ({stats['tool_calls']} tool calls, {stats['detours']} detours)")
    spec = TinySpec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        seed=config.seed,
        entity_tokens=config.entity_tokens,
        copy_heads=config.copy_heads,
        num_key_value_heads=config.kv_heads,
    )
    init_tiny(world, work / "tiny", sft_data=work / "sft.jsonl", spec=spec)
    boxed, teacher, note_pass = (
        config.boxed_pass_config(),
        config.teacher_sft_config(),
        config.note_pass_config(),
    )
    # the passes after the first learn from the boxed data when there is a boxed pass
    later_data = work / "sft.jsonl"
    if boxed is not None:
        later_data = work / "sft-boxed.jsonl"
        write_sft_data(world, later_data, final="boxed", **oracle)
    # the SFT-shaped stages in order, those that run: (stage, what it is, its data, its settings)
    passes = [
        ("sft", "SFT warm start", work / "sft.jsonl", config.sft_config()),
        ("boxed-pass", "SFT with the answer boxed first", later_data, boxed),
        ("teacher-sft", "SFT in the teacher's format", later_data, teacher),
    ]
    passes = [p for p in passes if p[3] is not None]
    # each stage starts from the one before; the last writes the target
    stages = [stage for stage, *_ in passes] + ["note-pass"] * (note_pass is not None)
    made = {stage: target if stage == stages[-1] else work / stage for stage in stages}
    last = work / "tiny"
    for stage, what, data, sft in passes:
        with progress_bar(what) as progress:
            result = run_sft(data, last, made[stage], sft, progress)
        say(
            f"{what}: loss {result['first_loss']:.3f} -> {result['final_loss']:.3f} in {result['seconds']:.0f}s"
        )
        last = made[stage]
    if note_pass is not None:
        with progress_bar("note pass", keys=tuple(LOSSES)) as progress:
            result = run_note_pass(later_data, last, target, note_pass, progress)
        say(f"note pass: {describe(result)}")
    stamp_world(target, fingerprint)
    return target
