"""``pbsd runs``: submit and watch runs on a trainer's REST API."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from pbsd.cli.errors import UserError, transport_reason
from pbsd.cli.inputs import read_document

app = typer.Typer(help="Submit and watch runs on a trainer's REST API.", no_args_is_help=True)
_URL = typer.Option(
    "http://127.0.0.1:8000", "--url", envvar="PBSD_TRAINER_URL", help="the trainer's base URL"
)
_TOKEN = typer.Option(None, "--token", envvar="PBSD_TRAINER_API_TOKEN", help="bearer token")


_TIMEOUT_S = 30.0


@contextmanager
def _api(url: str, token: str | None) -> Iterator:
    """A client of the trainer at ``url``; a trainer that cannot be reached is a user error
    that names the URL tried and the ways to point at one."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=_TIMEOUT_S) as client:
            yield client
    except httpx.TransportError as exc:
        raise UserError(
            f"no trainer at {url}: {transport_reason(exc)}; start one with `pbsd serve trainer`, "
            "or give its URL with --url or PBSD_TRAINER_URL"
        ) from None


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
        if response.status_code == 401:
            detail = f"{detail}: give the trainer's API token with --token or PBSD_TRAINER_API_TOKEN"
        raise UserError(f"the trainer answered {response.status_code}: {detail}")
    return response.json()


@app.command("submit")
def runs_submit(
    spec_file: Path = typer.Argument(
        ..., help="run specification, YAML or JSON", exists=True, dir_okay=False
    ),
    url: str = _URL,
    token: str | None = _TOKEN,
) -> None:
    """Submit a run; prints its id."""
    body = read_document(spec_file)
    with _api(url, token) as api:
        result = _check(api.post("/runs", json=body))
    typer.echo(result["id"])


@app.command("list")
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


@app.command("show")
def runs_show(run_id: str, url: str = _URL, token: str | None = _TOKEN) -> None:
    """A run's state, latest metrics and latest validation round, as JSON."""
    import json

    with _api(url, token) as api:
        typer.echo(json.dumps(_check(api.get(f"/runs/{run_id}")), indent=2))


@app.command("evals")
def runs_evals(run_id: str, url: str = _URL, token: str | None = _TOKEN) -> None:
    """A run's validation rounds: mean@k and pass@k by version.

    Only runs with data.validation have them.
    """
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


@app.command("cancel")
def runs_cancel(run_id: str, url: str = _URL, token: str | None = _TOKEN) -> None:
    """Stop a run after its current step."""
    with _api(url, token) as api:
        r = _check(api.post(f"/runs/{run_id}/cancel"))
    typer.echo(f"{r['id']} {r['state']}")


@app.command("delete")
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
