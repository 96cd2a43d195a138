"""The ``pbsd`` command line. Subcommands import their service lazily so that
``pbsd --help`` stays fast and never loads torch."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(
    help="pbsd: RL for long-horizon search agents with PBSD turn-level credit.", no_args_is_help=True
)
schemas_app = typer.Typer(help="Wire-contract JSON Schemas.", no_args_is_help=True)
app.add_typer(schemas_app, name="schemas")
world_app = typer.Typer(
    help="The embedded search world: knowledge graph, corpus, questions, SFT data.", no_args_is_help=True
)
app.add_typer(world_app, name="world")


@app.command()
def version() -> None:
    """Print the installed version."""
    from pbsd import __version__

    typer.echo(__version__)


@schemas_app.command("export")
def schemas_export() -> None:
    """Write the JSON Schema of every wire contract into proto/schemas/."""
    from proto.schemas_export import export

    for path in export():
        typer.echo(f"wrote {path}")


@schemas_app.command("check")
def schemas_check() -> None:
    """Exit 1 when proto/schemas/ differs from the models."""
    from proto.schemas_export import SCHEMA_DIR, render_schemas

    stale = [
        n
        for n, text in render_schemas().items()
        if not (SCHEMA_DIR / n).exists() or (SCHEMA_DIR / n).read_text() != text
    ]
    if stale:
        typer.echo(f"stale schemas: {', '.join(stale)}; run `pbsd schemas export`", err=True)
        raise typer.Exit(1)
    typer.echo("schemas are up to date")


serve_app = typer.Typer(help="Run one of the pipeline's services in the foreground.", no_args_is_help=True)
app.add_typer(serve_app, name="serve")


@serve_app.command("tools")
def serve_tools(
    host: str | None = typer.Option(None, help="bind address (default: PBSD_TOOLS_HOST or 127.0.0.1)"),
    port: int | None = typer.Option(None, help="port (default: PBSD_TOOLS_PORT or 8001)"),
) -> None:
    """The tool gateway (settings from PBSD_TOOLS_* and REDIS_URL)."""
    import uvicorn

    from services.tools.app import create_app
    from services.tools.settings import ToolsSettings

    settings = _service_settings(ToolsSettings)
    uvicorn.run(
        create_app(settings), host=host or settings.host, port=port or settings.port, log_level="warning"
    )


@serve_app.command("rollout")
def serve_rollout(
    host: str | None = typer.Option(None, help="bind address (default: PBSD_ROLLOUT_HOST or 127.0.0.1)"),
    port: int | None = typer.Option(
        None, help="port for /health and /metrics (default: PBSD_ROLLOUT_PORT or 8002)"
    ),
) -> None:
    """A rollout worker (settings from PBSD_ROLLOUT_* and REDIS_URL)."""
    import uvicorn

    from services.rollout.app import create_app
    from services.rollout.settings import RolloutSettings

    settings = _service_settings(RolloutSettings)
    uvicorn.run(
        create_app(settings), host=host or settings.host, port=port or settings.port, log_level="warning"
    )


@serve_app.command("scorer")
def serve_scorer(
    host: str | None = typer.Option(None, help="bind address (default: PBSD_SCORER_HOST or 127.0.0.1)"),
    port: int | None = typer.Option(
        None, help="port for /health and /metrics (default: PBSD_SCORER_PORT or 8003)"
    ),
) -> None:
    """The evidence scorer (settings from PBSD_SCORER_* and REDIS_URL)."""
    import uvicorn

    from services.scorer.app import create_app
    from services.scorer.settings import ScorerSettings

    settings = _service_settings(ScorerSettings)
    uvicorn.run(
        create_app(settings), host=host or settings.host, port=port or settings.port, log_level="warning"
    )


def _service_settings(cls):
    """A service's settings from its environment; what is wrong is said in a line each, named by
    its variable, instead of pydantic's traceback."""
    from pydantic import ValidationError

    try:
        return cls()
    except ValidationError as exc:
        prefix = cls.model_config.get("env_prefix", "")
        for error in exc.errors():
            where = f"{prefix}{'_'.join(map(str, error['loc'])).upper()}: " if error["loc"] else ""
            typer.echo(f"error: {where}{error['msg'].removeprefix('Value error, ')}", err=True)
        raise typer.Exit(2) from None


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@serve_app.command("trainer")
def serve_trainer(
    host: str | None = typer.Option(None, help="bind address (default: PBSD_TRAINER_HOST or 127.0.0.1)"),
    port: int | None = typer.Option(None, help="port of the REST API (default: PBSD_TRAINER_PORT or 8000)"),
    save_groups: bool | None = typer.Option(
        None,
        help="keep every step's scored groups (for reports and the credit viewer); "
        "default: PBSD_TRAINER_SAVE_GROUPS",
    ),
) -> None:
    """The trainer: REST API for runs and the run executor (settings from PBSD_TRAINER_* and REDIS_URL)."""
    import os

    import uvicorn

    from services.trainer.app import create_app
    from services.trainer.settings import TrainerSettings

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1  # started by the DeepSpeed launcher
    if distributed:
        import deepspeed

        deepspeed.init_distributed()
        if int(os.environ.get("RANK", "0")) != 0:
            from services.trainer.distributed import follow_rank0

            follow_rank0(device=f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if _cuda() else "cpu")
            return
    settings = _service_settings(TrainerSettings)
    if save_groups is not None:  # the flag, either way, over the environment
        settings = settings.model_copy(update={"save_groups": save_groups})
    host = host or settings.host
    if settings.api_token is None and not _loopback(host):
        raise typer.BadParameter(
            f"an API without a token (PBSD_TRAINER_LOCAL_MODE) binds to loopback only, not {host}: "
            "set PBSD_TRAINER_API_TOKEN to serve it on the network",
            param_hint="--host",
        )
    try:
        uvicorn.run(
            create_app(settings),
            host=host,
            port=port or settings.port,
            log_level="warning",
        )
    finally:
        if distributed:  # the other ranks wait in follow_rank0 for rank 0's next command
            from services.trainer.distributed import release_followers

            release_followers()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


model_app = typer.Typer(help="Policy checkpoints.", no_args_is_help=True)
app.add_typer(model_app, name="model")


@model_app.command("tiny")
def model_tiny(
    world: Path = typer.Option(..., help="a directory written by `pbsd world build`"),
    out: Path = typer.Option(..., help="checkpoint directory to write"),
    sft_data: Path | None = typer.Option(
        None, help="SFT conversations whose text the tokenizer also learns from"
    ),
    vocab_size: int = typer.Option(4096),
    hidden_size: int = typer.Option(128),
    layers: int = typer.Option(2),
    kv_heads: int = typer.Option(
        2, help="key-value groups of the 4 attention heads (4: one per head, so copy heads share nothing)"
    ),
    experts: int = typer.Option(8),
    top_k: int = typer.Option(2),
    seed: int = typer.Option(0),
    entity_tokens: bool = typer.Option(
        False, help="one token per entity name and page address, beside the BPE vocabulary"
    ),
    copy_heads: bool = typer.Option(
        False, help="hand-built heads that copy entity tokens from the context (needs --entity-tokens)"
    ),
) -> None:
    """Build the tiny Qwen3-MoE policy and its BPE tokenizer from a world (nothing is downloaded)."""
    from services.model.tiny import TinySpec, init_tiny

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
    path = init_tiny(world, out, sft_data=sft_data, spec=spec)
    typer.echo(f"wrote {path}")


@model_app.command("copy-probe")
def model_copy_probe(
    model: Path = typer.Option(..., help="the checkpoint to probe"),
    data: Path = typer.Option(
        ..., help="oracle conversations, e.g. `pbsd world sft-data --split validation`"
    ),
    limit: int | None = typer.Option(None, help="probe only the first N conversations"),
) -> None:
    """Teacher-forced greedy accuracy on the spans an episode hinges on: queries, URLs, read requests, boxed answers."""
    from services.trainer.copy_probe import copy_probe

    for kind, r in copy_probe(model, data, limit=limit).items():
        typer.echo(f"{kind:8s} {r['right']:5d} / {r['total']:5d}  {r['accuracy']:.3f}")


@app.command("sft")
def sft_cmd(
    data: Path = typer.Option(..., help="JSONL of chat conversations (e.g. from `pbsd world sft-data`)"),
    model: Path = typer.Option(..., help="the checkpoint to start from"),
    out: Path = typer.Option(..., help="checkpoint directory to write"),
    epochs: int = typer.Option(2),
    lr: float = typer.Option(1e-5, help="the paper's SFT learning rate (a tiny model wants ~1e-3)"),
    batch_size: int = typer.Option(32, help="conversations per optimiser step"),
    warmup_steps: int = typer.Option(10),
    lr_decay: str = typer.Option("constant", help="after warm-up: constant, or cosine to lr/10 at the end"),
    micro_batch_tokens: int = typer.Option(16_384),
    max_tokens: int = typer.Option(65_536, help="longer conversations are skipped"),
    seed: int = typer.Option(0),
    save_every_epoch: bool = typer.Option(False, help="also write <out>-epoch-<n> after each epoch"),
    loss_on: str = typer.Option(
        "assistant", help="assistant: learn the assistant's tokens; turns: the tool results too"
    ),
) -> None:
    """Supervised fine-tuning (assistant tokens, or every turn): the warm start before RL."""
    from services.trainer.sft import SftConfig, progress_bar, run_sft

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
        )
    except ValueError as e:  # the choices live in SftConfig; say it as a usage error
        raise typer.BadParameter(str(e)) from None
    with progress_bar("sft") as progress:
        stats = run_sft(data, model, out, config, progress)
    typer.echo(
        f"wrote {out}: {stats['steps']} steps, loss {stats['first_loss']:.3f} -> {stats['final_loss']:.3f} "
        f"in {stats['seconds']:.0f}s"
    )


runs_app = typer.Typer(help="Submit and watch runs on a trainer's REST API.", no_args_is_help=True)
app.add_typer(runs_app, name="runs")
_URL = typer.Option(
    "http://127.0.0.1:8000", "--url", envvar="PBSD_TRAINER_URL", help="the trainer's base URL"
)
_TOKEN = typer.Option(None, "--token", envvar="PBSD_TRAINER_API_TOKEN", help="bearer token")


def _api(url: str, token: str | None):
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=30)


def _check(response) -> dict | list:
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail")
        except ValueError:
            detail = response.text
        if isinstance(detail, dict):  # {"msg": ..., and what it is about}
            detail = detail.get("msg", detail)
        if isinstance(detail, list):
            detail = "; ".join(
                f"{'.'.join(str(p) for p in d.get('loc', [])[1:])}: {d.get('msg')}" for d in detail
            )
        typer.echo(f"error {response.status_code}: {detail}", err=True)
        raise typer.Exit(1)
    return response.json()


@runs_app.command("submit")
def runs_submit(
    spec_file: Path = typer.Argument(..., help="run specification, YAML or JSON"),
    url: str = _URL,
    token: str | None = _TOKEN,
) -> None:
    """Submit a run; prints its id."""
    import yaml

    body = yaml.safe_load(spec_file.read_text())
    with _api(url, token) as api:
        result = _check(api.post("/runs", json=body))
    typer.echo(result["id"])


@runs_app.command("list")
def runs_list(url: str = _URL, token: str | None = _TOKEN) -> None:
    """Every run, newest first."""
    with _api(url, token) as api:
        runs = _check(api.get("/runs"))
        if not runs:
            typer.echo("no runs")
        for r in runs:
            typer.echo(
                f"{r['id']}  {r['state']:10} step {r['step']:>5}  v{r['policy_version']:<5} {r['name']}"
            )


@runs_app.command("show")
def runs_show(run_id: str, url: str = _URL, token: str | None = _TOKEN) -> None:
    """A run's state, latest metrics and latest validation round, as JSON."""
    import json

    with _api(url, token) as api:
        typer.echo(json.dumps(_check(api.get(f"/runs/{run_id}")), indent=2))


@runs_app.command("evals")
def runs_evals(run_id: str, url: str = _URL, token: str | None = _TOKEN) -> None:
    """A run's validation rounds (runs with data.validation): mean@k and pass@k by policy version."""
    with _api(url, token) as api:
        rounds = _check(api.get(f"/runs/{run_id}/evals"))
    if not rounds:
        typer.echo("no validation round recorded yet (a run without data.validation never has one)")
    for r in rounds:
        k, acc = r["samples"], r["accuracy"]["all"]
        typer.echo(
            f"v{r['version']:<5} step {r['step']:>5}  mean@{k} {acc[f'mean@{k}']:.3f}  "
            f"pass@{k} {acc['pass@k'][str(k)]:.3f}  on {r['questions']} questions"
        )


@runs_app.command("cancel")
def runs_cancel(run_id: str, url: str = _URL, token: str | None = _TOKEN) -> None:
    """Stop a run after its current step."""
    with _api(url, token) as api:
        r = _check(api.post(f"/runs/{run_id}/cancel"))
    typer.echo(f"{r['id']} {r['state']}")


@runs_app.command("delete")
def runs_delete(
    run_id: str,
    files: bool = typer.Option(False, help="also remove the run's folder (checkpoints, weights, metrics)"),
    url: str = _URL,
    token: str | None = _TOKEN,
) -> None:
    """Forget a finished run (cancel an active one first)."""
    with _api(url, token) as api:
        response = api.delete(f"/runs/{run_id}", params={"files": files})
        if response.status_code != 204:
            _check(response)
    typer.echo(f"{run_id} deleted" + (" with its files" if files else ""))


@app.command("demo")
def demo_cmd(
    out: Path | None = typer.Option(None, help="output folder (default: runs/demo-<time>)"),
    algorithm: str | None = typer.Option(
        None, help="pbsd (default), grpo, or both (the same pipeline, compared)"
    ),
    steps: int | None = typer.Option(None, help="training steps"),
    prompts_per_step: int | None = typer.Option(None),
    group_size: int | None = typer.Option(None),
    eval_questions: int | None = typer.Option(None, help="held-out questions evaluated before and after"),
    max_turns: int | None = typer.Option(None),
    max_tokens_per_turn: int | None = typer.Option(None),
    from_scratch: bool = typer.Option(
        False, help="rebuild the warm policy (oracle data, tokenizer, SFT) instead of using the committed one"
    ),
    config: Path | None = typer.Option(
        None, help="a YAML or JSON file of demo settings (see demo/config.py)"
    ),
    policy: Path | None = typer.Option(None, help="start from this checkpoint instead of the warm policy"),
    stall_timeout: float | None = typer.Option(
        None, help="stop a run that makes no training step for this many seconds (default 600)"
    ),
) -> None:
    """Train a tiny search agent end to end on this machine and write a report."""
    import time

    from agent.grounding import describe
    from demo.config import DemoConfig
    from demo.run import run_demo
    from services.rollout.evaluate import describe_change

    settings = DemoConfig.load(
        config,
        algorithm=algorithm,
        steps=steps,
        prompts_per_step=prompts_per_step,
        group_size=group_size,
        eval_questions=eval_questions,
        max_turns=max_turns,
        max_tokens_per_turn=max_tokens_per_turn,
        stall_timeout_s=stall_timeout,
        from_scratch=True if from_scratch else None,  # the flag's default leaves the file's value
        policy=str(policy) if policy is not None else None,
    )
    out = out or Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    result = run_demo(settings, out)
    k = settings.eval_samples
    typer.echo("\n" + "=" * 72)
    typer.echo(f"pbsd demo finished in {result['seconds'] / 60:.1f} min: {out}")
    for name, report in result["evals"].items():
        acc = report["accuracy"]["all"]
        typer.echo(
            f"  {name:14} mean@{k} {acc[f'mean@{k}']:.3f}   turns {report['mean_turns']:.1f}   "
            f"tool calls {report['tool_calls']} ({report['tool_errors']} failed)   "
            f"finish {report['finish_reasons']}\n  {'':14} {describe(report['grounding'])}"
        )
        if "change" in report:
            typer.echo(f"  {'':14} change {describe_change(report['change'])}")
    for algo, run in result["runs"].items():
        m = run["record"]["latest_metrics"]
        extra = (
            f", teacher>student {m['teacher_higher_frac']:.2f}, filtered {m['filtered_frac']:.2f}"
            if "teacher_higher_frac" in m
            else ""
        )
        typer.echo(
            f"  {algo.upper()} run {run['id']}: {int(m.get('step', 0))} steps, last batch accuracy "
            f"{m.get('accuracy', 0):.2f}{extra}"
        )
    typer.echo(f"  report: {result['report']}")
    typer.echo("=" * 72)


@app.command("eval")
def eval_cmd(
    model: Path = typer.Option(..., help="policy checkpoint (HF directory with its tokenizer)"),
    questions: Path = typer.Option(
        ..., help="question file (world format, {question, answer} or BrowseComp's)"
    ),
    out: Path = typer.Option(Path("eval.json"), help="JSON report to write"),
    samples: int = typer.Option(4, help="samples per question (the paper reports mean@4)"),
    corpus: Path | None = typer.Option(None, help="offline corpus: run the tool gateway in process over it"),
    tools_url: str | None = typer.Option(None, help="a running tool gateway instead of --corpus"),
    sglang_url: list[str] = typer.Option([], help="SGLang servers; the in-process engine when none"),
    limit: int | None = typer.Option(None, help="evaluate only the first N questions"),
    max_turns: int = typer.Option(300),
    max_tokens_per_turn: int = typer.Option(16_384),
    max_context: int = typer.Option(65_536),
    temperature: float = typer.Option(1.0),
    top_p: float = typer.Option(0.95, help="the paper evaluates with top-p 0.95"),
    concurrency: int = typer.Option(4, help="trajectories in flight"),
    date: str | None = typer.Option(None, help="'today' in the system prompt"),
    seed: int | None = typer.Option(None),
    compare_to: Path | None = typer.Option(
        None,
        help="an earlier report of this command on the same questions (say, of the policy before "
        "training, with the same --seed): the report adds the change from it, per question paired",
    ),
) -> None:
    """Evaluate a policy: accuracy as mean@k and pass@k, per difficulty, with a JSON report (with
    PBSD_JUDGE_BASE_URL set, also as graded by that LLM judge)."""
    import asyncio
    import json

    from services.rollout.agent import AgentLimits
    from services.rollout.evaluate import compare, describe_change
    from services.rollout.runner import eval_main

    if (corpus is None) == (tools_url is None):
        raise typer.BadParameter("give exactly one of --corpus and --tools-url")
    before = json.loads(compare_to.read_text()) if compare_to is not None else None
    limits = AgentLimits(
        max_turns=max_turns,
        max_tokens_per_turn=max_tokens_per_turn,
        max_context=max_context,
        temperature=temperature,
        top_p=top_p,
    )
    report = asyncio.run(
        eval_main(
            model,
            questions,
            samples=samples,
            corpus=corpus,
            tools_url=tools_url,
            sglang_urls=list(sglang_url),
            limit=limit,
            limits=limits,
            concurrency=concurrency,
            date=date,
            seed=seed,
        )
    )
    mismatch = None
    if before is not None:
        try:
            report["change"] = compare(before, report)
        except ValueError as exc:
            mismatch = exc  # refused once the report is written: the evaluation is not lost
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    if mismatch is not None:
        raise typer.BadParameter(f"{compare_to}: {mismatch} (report in {out})", param_hint="--compare-to")
    from agent.grounding import describe

    overall = report["accuracy"]["all"]
    typer.echo(
        f"mean@{samples} {overall[f'mean@{samples}']:.3f}, pass@{samples} {overall['pass@k'][str(samples)]:.3f} "
        f"over {report['questions']} questions; {describe(report['grounding'])}; report in {out}"
    )
    if "judged_accuracy" in report:
        typer.echo(
            f"judged (PBSD_JUDGE_MODEL): mean@{samples} {report['judged_accuracy']['all'][f'mean@{samples}']:.3f}"
        )
    if "change" in report:
        typer.echo(f"change from {compare_to}: {describe_change(report['change'])}")


@world_app.command("build")
def world_build(
    out: Path = typer.Option(..., "--out", help="directory to write the world into"),
    # the defaults are the demo's world (demo/config.py), the one the committed policy was made for
    seed: int = typer.Option(0, help="same seed and sizes, same bytes"),
    entities: int = typer.Option(2000, help="number of entities in the knowledge graph"),
    questions: int | None = typer.Option(
        None, help="size of the question pool (default: what the splits need + 30%)"
    ),
    rl: int = typer.Option(575, help="questions in the RL split"),
    validation: int = typer.Option(200, help="questions in the validation split"),
    sft: int = typer.Option(6000, help="questions in the SFT split"),
    parquet: bool = typer.Option(False, help="also write Parquet files (needs pyarrow)"),
) -> None:
    """Generate a world: graph, one document per entity, multi-hop questions with unique answers."""
    from worldgen.build import build_world

    result = build_world(
        out,
        seed=seed,
        entities=entities,
        n_rl=rl,
        n_val=validation,
        n_sft=sft,
        questions=questions,
        parquet=parquet,
    )
    sizes = ", ".join(f"{k} {len(v)}" for k, v in result.splits.items())
    timing = ", ".join(f"{k} {v:.1f}s" for k, v in result.timings.items())
    typer.echo(f"wrote {out}: {len(result.graph.entities)} entities, questions: {sizes} ({timing})")


@world_app.command("demo-questions")
def world_demo_questions(
    world: Path = typer.Option(..., "--world", help="a directory written by `pbsd world build`"),
    out: Path = typer.Option(..., "--out", help="folder to write rl.jsonl and eval.jsonl into"),
    config: Path | None = typer.Option(
        None, help="a YAML or JSON file of demo settings (see demo/config.py); default: the demo's"
    ),
) -> None:
    """Write the question files `pbsd demo` trains and evaluates on (demo/questions.py): the RL
    questions of its difficulties, less the held-out ones in eval.jsonl. The Compose run
    (deploy/runs/demo-cpu.yaml) uses them, so that it measures what the demo measures."""
    from demo.config import DemoConfig
    from demo.questions import question_files

    files = question_files(DemoConfig.load(config), world, out)
    typer.echo(
        f"wrote {files.train} ({files.train_questions} questions) and {files.evaluation} "
        f"({files.evaluation_questions})"
    )


@world_app.command("fingerprint")
def world_fingerprint_cmd(
    world: Path = typer.Option(..., "--world", help="a directory written by `pbsd world build`"),
    stamp: Path | None = typer.Option(
        None, help="a checkpoint supervised on this world: record the fingerprint in its pbsd.json"
    ),
) -> None:
    """Print the world's fingerprint (SHA-256 over its files' hashes); `pbsd demo` reuses a warm
    policy only when its pbsd.json names the fingerprint of the world the demo builds."""
    import json

    from worldgen.build import world_fingerprint

    manifest = world / "manifest.json"
    if not manifest.exists():
        raise typer.BadParameter(f"{manifest} not found: not a world", param_hint="--world")
    fingerprint = world_fingerprint(json.loads(manifest.read_text()))
    if stamp is not None:
        from services.model.checkpoint import stamp_world

        stamp_world(stamp, fingerprint)
    typer.echo(fingerprint)


@world_app.command("sft-data")
def world_sft_data(
    world: Path = typer.Option(..., "--world", help="a directory written by `pbsd world build`"),
    out: Path = typer.Option(..., "--out", help="JSONL file of chat trajectories to write"),
    split: str = typer.Option("sft", help="which question split to solve"),
    limit: int | None = typer.Option(None, help="solve only the first N questions"),
    seed: int = typer.Option(0),
    detour_rate: float = typer.Option(
        0.25, help="chance of a detour (vague search, wrong page, re-check) at each step"
    ),
    search_num: int = typer.Option(5, help="results the oracle asks of each search"),
    rename: float = typer.Option(
        0.0,
        help="fraction of trajectories whose invented names are renamed consistently "
        "(fresh per trajectory), so they can only be fitted by copying (worldgen/rename.py)",
    ),
) -> None:
    """Write oracle trajectories (the scripted expert using the offline tools) for the SFT warm start."""
    from worldgen.oracle import write_sft_data

    stats = write_sft_data(
        world,
        out,
        split=split,
        limit=limit,
        seed=seed,
        detour_rate=detour_rate,
        search_num=search_num,
        rename=rename,
    )
    typer.echo(
        f"wrote {stats['written']} trajectories to {out} ({stats['skipped']} questions skipped, "
        f"{stats['tool_calls']} tool calls, {stats['detours']} detours, {stats['renamed']} renamed)"
    )


if __name__ == "__main__":
    app()
