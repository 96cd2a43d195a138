"""``pbsd serve``: one of the pipeline's services in the foreground, configured from its environment.

Each command reads its settings before it imports its app (and torch): a wrong setting is said
at once, in a line a setting.
"""

from __future__ import annotations

import typer

app = typer.Typer(help="Run one of the pipeline's services in the foreground.", no_args_is_help=True)


@app.command("tools")
def serve_tools(
    host: str | None = typer.Option(None, help="bind address (default: PBSD_TOOLS_HOST or 127.0.0.1)"),
    port: int | None = typer.Option(None, min=1, max=65535, help="port (default: PBSD_TOOLS_PORT or 8001)"),
) -> None:
    """The tool gateway (settings from PBSD_TOOLS_* and REDIS_URL)."""
    from services.tools.settings import ToolsSettings

    settings = _service_settings(ToolsSettings)  # before the app and its imports: a bad setting is one line
    import uvicorn

    from services.tools.app import create_app
    from services.tools.cpu import responsive_switching

    responsive_switching()  # the event loop waits for no search thread longer than half a millisecond
    # uvicorn picks uvloop and httptools (dependencies) over asyncio's loop and h11; the access log
    # would format a line for every call of the hot path
    uvicorn.run(
        create_app(settings),
        host=_bind_host(host, settings),
        port=port or settings.port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=settings.keep_alive_s,
    )


@app.command("rollout")
def serve_rollout(
    host: str | None = typer.Option(None, help="bind address (default: PBSD_ROLLOUT_HOST or 127.0.0.1)"),
    port: int | None = typer.Option(
        None, min=1, max=65535, help="port for /health and /metrics (default: PBSD_ROLLOUT_PORT or 8002)"
    ),
) -> None:
    """A rollout worker (settings from PBSD_ROLLOUT_* and REDIS_URL)."""
    from services.rollout.settings import RolloutSettings

    settings = _service_settings(RolloutSettings)
    import uvicorn

    from services.rollout.app import create_app

    uvicorn.run(
        create_app(settings),
        host=_bind_host(host, settings),
        port=port or settings.port,
        log_level="warning",
    )


@app.command("scorer")
def serve_scorer(
    host: str | None = typer.Option(None, help="bind address (default: PBSD_SCORER_HOST or 127.0.0.1)"),
    port: int | None = typer.Option(
        None, min=1, max=65535, help="port for /health and /metrics (default: PBSD_SCORER_PORT or 8003)"
    ),
) -> None:
    """The evidence scorer (settings from PBSD_SCORER_* and REDIS_URL)."""
    from services.scorer.settings import ScorerSettings

    settings = _service_settings(ScorerSettings)
    import uvicorn

    from services.scorer.app import create_app

    uvicorn.run(
        create_app(settings),
        host=_bind_host(host, settings),
        port=port or settings.port,
        log_level="warning",
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


def _bind_host(option: str | None, settings) -> str:
    """The address to bind, the option's or the settings' (``PBSD_*_HOST``), refused in a line
    naming where it came from when the resolver does not know it: uvicorn says only "[Errno -2]
    Name or service not known" and exits 3."""
    import socket

    host = option or settings.host
    variable = f"{settings.model_config.get('env_prefix', '')}HOST"
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        why = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise typer.BadParameter(
            f"cannot bind to {host!r}: {why}", param_hint="--host" if option else variable
        ) from None
    return host


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@app.command("trainer")
def serve_trainer(
    host: str | None = typer.Option(None, help="bind address (default: PBSD_TRAINER_HOST or 127.0.0.1)"),
    port: int | None = typer.Option(
        None, min=1, max=65535, help="port of the REST API (default: PBSD_TRAINER_PORT or 8000)"
    ),
    save_groups: bool | None = typer.Option(
        None,
        help="keep every step's scored groups (for reports and the credit viewer); "
        "default: PBSD_TRAINER_SAVE_GROUPS",
    ),
) -> None:
    """The trainer: REST API for runs and the run executor.

    Settings from PBSD_TRAINER_* and REDIS_URL.
    """
    import os

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
    import uvicorn

    from services.trainer.app import create_app

    if save_groups is not None:  # the flag, either way, over the environment
        settings = settings.model_copy(update={"save_groups": save_groups})
    host = _bind_host(host, settings)
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
