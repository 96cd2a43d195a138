"""``pbsd model`` (build and probe the tiny policy) and ``pbsd sft`` (the warm start)."""

from __future__ import annotations

from pathlib import Path

import typer

from pbsd.cli.errors import UserError
from pbsd.cli.inputs import checkpoint_dir, conversations_file, positive, share, world_dir

app = typer.Typer(help="Policy checkpoints.", no_args_is_help=True)


@app.command("tiny")
def model_tiny(
    world: Path = typer.Option(..., help="a directory written by `pbsd world build`", callback=world_dir),
    out: Path = typer.Option(..., help="checkpoint directory to write"),
    sft_data: Path | None = typer.Option(
        None,
        help="SFT conversations whose text the tokenizer also learns from",
        exists=True,
        dir_okay=False,
        callback=conversations_file,
    ),
    vocab_size: int = typer.Option(4096, min=1),
    hidden_size: int = typer.Option(128, min=1),
    layers: int = typer.Option(2, min=1),
    kv_heads: int = typer.Option(
        2,
        min=1,
        help="key-value groups of the 4 attention heads (4: one per head, so copy heads share nothing)",
    ),
    experts: int = typer.Option(8, min=1),
    top_k: int = typer.Option(2, min=1),
    seed: int = typer.Option(0, min=0),
    entity_tokens: bool = typer.Option(
        False, help="one token per entity name and page address, beside the BPE vocabulary"
    ),
    copy_heads: bool = typer.Option(
        False, help="hand-built heads that copy entity tokens from the context (needs --entity-tokens)"
    ),
) -> None:
    """Build the tiny Qwen3-MoE policy and its tokenizer.

    The BPE tokenizer learns the world's text (and --sft-data's); nothing is downloaded.
    """
    from services.model.tiny import TinySpec, init_tiny

    try:
        spec = TinySpec(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_hidden_layers=layers,
            num_key_value_heads=kv_heads,
            num_experts=experts,
            num_experts_per_tok=top_k,
            seed=seed,
            entity_tokens=entity_tokens,
            copy_heads=copy_heads,
        )
    except ValueError as exc:  # a shape the model cannot run
        raise typer.BadParameter(str(exc)) from None
    path = init_tiny(world, out, sft_data=sft_data, spec=spec)
    typer.echo(f"wrote {path}")


@app.command("grow")
def model_grow(
    model: Path = typer.Option(..., help="the checkpoint to deepen", callback=checkpoint_dir),
    out: Path = typer.Option(..., help="checkpoint directory to write"),
    layers: int = typer.Option(1, min=1, help="decoder layers to add"),
    after: int = typer.Option(-1, help="insert them after this layer (-1: on top)"),
    source: int | None = typer.Option(None, help="the layer they copy (default: --after's)"),
) -> None:
    """Add decoder layers that compute nothing yet (block expansion).

    Each is a copy of an existing layer with its output projections zeroed, so the grown model
    gives the same logits; `pbsd teacher teach --train-layers grown` then trains them alone
    (services/model/grow.py)."""
    from services.model.grow import grow_checkpoint

    try:
        record = grow_checkpoint(model, out, layers, after=after, source=source)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    typer.echo(
        f"wrote {out}: {record['layers_before'] + len(record['added'])} layers, "
        f"{record['added']} added as copies of layer {record['source']}"
    )


@app.command("copy-probe")
def model_copy_probe(
    model: Path = typer.Option(..., help="the checkpoint to probe", callback=checkpoint_dir),
    data: Path = typer.Option(
        ...,
        help="oracle conversations, e.g. `pbsd world sft-data --split validation`",
        exists=True,
        dir_okay=False,
        callback=conversations_file,
    ),
    limit: int | None = typer.Option(None, min=1, help="probe only the first N conversations"),
) -> None:
    """Teacher-forced accuracy on the spans an episode hinges on.

    Greedy next-token accuracy on search queries, URLs, read requests and boxed answers.
    """
    from services.trainer.copy_probe import copy_probe

    for kind, r in copy_probe(model, data, limit=limit).items():
        typer.echo(f"{kind:8s} {r['right']:5d} / {r['total']:5d}  {r['accuracy']:.3f}")


def sft_cmd(
    data: Path = typer.Option(
        ...,
        help="JSONL of chat conversations (e.g. from `pbsd world sft-data`)",
        exists=True,
        dir_okay=False,
        callback=conversations_file,
    ),
    model: Path = typer.Option(..., help="the checkpoint to start from", callback=checkpoint_dir),
    out: Path = typer.Option(..., help="checkpoint directory to write"),
    epochs: int = typer.Option(2, min=1),
    lr: float = typer.Option(
        1e-5, callback=positive, help="the paper's SFT learning rate (a tiny model wants ~1e-3)"
    ),
    batch_size: int = typer.Option(32, min=1, help="conversations per optimiser step"),
    warmup_steps: int = typer.Option(0, min=0, help="0: the learning rate fixed, as the paper's SFT"),
    lr_decay: str = typer.Option("constant", help="after warm-up: constant, or cosine to lr/10 at the end"),
    micro_batch_tokens: int = typer.Option(16_384, min=1),
    max_tokens: int = typer.Option(65_536, min=1, help="longer conversations are skipped"),
    seed: int = typer.Option(0, min=0),
    save_every_epoch: bool = typer.Option(False, help="also write <out>-epoch-<n> after each epoch"),
    loss_on: str = typer.Option(
        "assistant", help="assistant: learn the assistant's tokens; turns: the tool results too"
    ),
    teacher_format: list[str] = typer.Option(
        [],
        help="NAME:FRACTION (NAME answer, answer-first, support or support-first, the teacher templates of proto/templates.py): also "
        "learn that fraction of the conversations after the teacher's privileged prompt; repeatable",
    ),
    teacher_contradict: float = typer.Option(
        0.0,
        callback=share,
        help="the share of the teacher-format copies whose tool results name a decoy in place of the "
        "answer, so that only x* states it (services/trainer/teacher_sft.py)",
    ),
    limit: int | None = typer.Option(None, min=1, help="learn only the first N conversations of --data"),
) -> None:
    """Supervised fine-tuning: the warm start before RL.

    Learns the assistant's tokens of the conversations in --data (with --loss-on turns, the tool
    results too).
    """
    from services.trainer.sft import SftConfig, UnusableData, progress_bar, run_sft
    from services.trainer.teacher_sft import parse_teacher_formats

    try:
        config = SftConfig(
            epochs=epochs,
            lr=lr,
            batch_size=batch_size,
            warmup_steps=warmup_steps,
            lr_decay=lr_decay,
            micro_batch_tokens=micro_batch_tokens,
            max_tokens=max_tokens,
            seed=seed,
            save_every_epoch=save_every_epoch,
            loss_on=loss_on,
            teacher_formats=parse_teacher_formats(teacher_format),
            teacher_contradict=teacher_contradict,
            limit=limit,
        )
    except ValueError as e:  # the choices live in SftConfig; say it as a usage error
        raise typer.BadParameter(str(e)) from None
    try:
        with progress_bar("sft") as progress:
            stats = run_sft(data, model, out, config, progress)
    except UnusableData as exc:
        raise UserError(str(exc), code=2) from None
    typer.echo(
        f"wrote {out}: {stats['steps']} steps, loss {stats['first_loss']:.3f} -> {stats['final_loss']:.3f} "
        f"in {stats['seconds']:.0f}s"
    )
