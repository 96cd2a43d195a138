"""``pbsd runs``: submit and watch runs on a trainer's REST API."""

from __future__ import annotations

import datetime
import hashlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import typer

from pbsd.cli.errors import UserError, problems, transport_reason
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
    from urllib.parse import urlsplit

    import httpx

    def wrong(why: str) -> UserError:  # nothing was tried: the URL is wrong
        return UserError(
            f"{url} is {why}: give the trainer's URL as http://HOST:PORT with --url or PBSD_TRAINER_URL"
        )

    try:
        port = urlsplit(url).port  # httpx takes a port past 65535, and the connection is refused
    except ValueError as exc:
        raise wrong(f"not a URL ({exc})") from None
    if port == 0:
        raise wrong("not a URL (port 0)")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=_TIMEOUT_S) as client:
            yield client
    except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
        raise wrong(transport_reason(exc)) from None
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


def spec_json(path: Path, document: object) -> str:
    """The spec as the request's JSON. YAML reads ``name: 2020-01-01`` as a date, which is meant as
    its text; ``.nan`` and ``.inf`` no JSON can hold, and the trainer would refuse them anyway."""

    def text(value: object) -> str:
        if isinstance(value, datetime.date | datetime.datetime):
            return str(value)  # as YAML spells it: "2020-01-01", "2020-01-01 10:00:00"
        raise TypeError(f"a {type(value).__name__} value ({value!r:.60}) is not JSON")

    try:
        return json.dumps(document, default=text, allow_nan=False)
    except (TypeError, ValueError) as exc:  # ValueError: NaN or Infinity
        raise UserError(f"{path}: cannot be sent as JSON: {exc}") from None


def _check_spec(path: Path, body: str) -> None:
    """The trainer's own validation, run here first: a spec that cannot be a run is said with the
    fields at fault, whether or not a trainer answers (its paths are the trainer's, checked there)."""
    from pydantic import ValidationError

    from proto.runs import RunSpec

    try:
        RunSpec.model_validate_json(body)
    except ValidationError as exc:
        raise UserError(f"{path}: not a run specification: {problems(exc)}") from None


@app.command("submit")
def runs_submit(
    spec_file: Path = typer.Argument(
        ..., help="run specification, YAML or JSON", exists=True, dir_okay=False
    ),
    url: str = _URL,
    token: str | None = _TOKEN,
) -> None:
    """Submit a run; prints its id."""
    body = spec_json(spec_file, read_document(spec_file))
    _check_spec(spec_file, body)
    with _api(url, token) as api:
        result = _check(api.post("/runs", content=body, headers={"content-type": "application/json"}))
    typer.echo(result["id"])


@app.command("list")
def runs_list(
    url: str = _URL,
    token: str | None = _TOKEN,
    limit: int = typer.Option(100, min=1, max=1000, help="the newest N runs"),
) -> None:
    """The newest runs, newest first."""
    with _api(url, token) as api:
        runs = _check(api.get("/runs", params={"limit": limit}))
        if not runs:
            typer.echo("no runs")
        for r in runs:
            typer.echo(
                f"{r['id']}  {r['state']:10} step {r['step']:>5}  v{r['policy_version']:<5} {r['name']}"
            )


@app.command("show")
def runs_show(run_id: str, url: str = _URL, token: str | None = _TOKEN) -> None:
    """A run's state, latest metrics and latest validation round, as JSON."""
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
        typer.echo(_eval_line(r))


def _eval_line(r: dict) -> str:
    k, acc = r["samples"], r["accuracy"]["all"]
    return (
        f"v{r['version']:<5} step {r['step']:>5}  mean@{k} {acc[f'mean@{k}']:.3f}  "
        f"pass@{k} {acc['pass@k'][str(k)]:.3f}  on {r['questions']} questions"
    )


def _step_line(m: dict) -> str:
    """One training step: reward, the update, and for PBSD what the teacher made of the answer."""
    line = (
        f"step {int(m['step']):>5}  v{int(m.get('policy_version') or 0):<5} "
        f"reward {_n(m.get('reward_mean'), '.3f')}  loss {_n(m.get('loss'), '+.4f')}  "
        f"grad {_n(m.get('grad_norm'), '.3f')}  {_n(m.get('step_s'), '.1f')} s"
    )
    if m.get("skipped_update"):
        line += "  UPDATE SKIPPED"
    if "answer_free_mean_s" in m:  # a PBSD step (docs/credit-signal.md has the targets)
        line += f"  | answer-free s {_n(m['answer_free_mean_s'], '+.4f')}"
        for kind, frac, what in _FINALS:
            if m.get(f"{kind}_turns"):  # a step with no such final has no fraction to show
                line += f"  {what} {_n(m.get(frac), '.0%')} of {int(m[f'{kind}_turns'])}"
    return line


def _n(value, spec: str) -> str:
    """A figure of a record, "-" where it has none: the API sends a NaN (a skipped update's
    gradient norm) as null."""
    return "-" if value is None else format(value, spec)


_FINALS = (
    ("wrong_final", "wrong_final_disfavoured_frac", "wrong finals down"),
    ("correct_final", "correct_final_favoured_frac", "right finals up"),
)
_ENDED = ("completed", "cancelled", "failed")


@app.command("watch")
def runs_watch(
    run_id: str,
    interval: float = typer.Option(5.0, min=0.1, help="seconds between two looks"),
    timeout: float = typer.Option(0.0, min=0, help="give up after this many seconds (0: when the run ends)"),
    url: str = _URL,
    token: str | None = _TOKEN,
) -> None:
    """Follow a run: a line per step and validation round, until it ends.

    Exits 0 when the run completes; 1 when it fails or is cancelled, or --timeout passes first."""
    series = (_Series("metrics", _step_line), _Series("evals", _eval_line))
    deadline = time.monotonic() + timeout if timeout else None
    state, step, away = "unseen", 0, None
    with _api(url, token) as api:
        while True:
            # a trainer that answered once and then does not is restarting (a resume follows one),
            # and is waited for; one never reached is a wrong URL, said at once
            look = partial(_look, api, wait=state != "unseen")
            try:
                record = look(f"/runs/{run_id}")  # before the series: what ended is all in them
                for s in series:
                    for line in s.new_lines(look, run_id):
                        typer.echo(line)
            except _Away as exc:
                if away is None:
                    typer.echo(f"(the trainer does not answer: {exc}; waiting for it)", err=True)
                away = exc
            else:
                away = None
                state, step = record["state"], record["step"]
                if state == "completed":
                    typer.echo(f"{run_id} completed at step {step}")
                    return
                if state in _ENDED:
                    error = f": {record['error']}" if record.get("error") else ""
                    raise UserError(f"run {run_id} {state} at step {step}{error}")
            if deadline is not None and time.monotonic() >= deadline:
                last = (
                    f"the trainer does not answer ({away})" if away else f"it is still {state} at step {step}"
                )
                raise UserError(f"run {run_id}: {last} after {timeout:g} s")
            time.sleep(interval)


class _Away(Exception):
    """The trainer cannot answer for now: not listening, or a proxy's or its own 502-504."""


def _look(api, path: str, params: dict | None = None, *, wait: bool):
    import httpx

    try:
        response = api.get(path, params=params)
    except httpx.TransportError as exc:
        if not wait:
            raise
        raise _Away(transport_reason(exc)) from None
    if wait and response.status_code in (502, 503, 504):
        raise _Away(f"it answered {response.status_code}")
    return _check(response)


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


class _Series:
    """The records of one of a run's series not yet shown. A resumed run records its steps again
    from its checkpoint on (the steps a crash lost are trained again), so each look reads the last
    record shown once more: if it changed, the series is read whole and shown again from where
    it parts from what was shown."""

    def __init__(self, name: str, line) -> None:
        self.name, self.line = name, line
        self.shown: list[bytes] = []  # a digest of each record shown: 8 bytes a step, however long the run

    def new_lines(self, look, run_id: str) -> list[str]:
        """What came since the last call; nothing is marked shown unless every read succeeded."""
        since = max(len(self.shown) - 1, 0)
        records = look(f"/runs/{run_id}/{self.name}", {"since": since})
        digests = [_digest(r) for r in records]
        notice = []
        if self.shown and digests[:1] != self.shown[-1:]:
            records = look(f"/runs/{run_id}/{self.name}")
            digests = [_digest(r) for r in records]
            kept = next(
                (i for i, (a, b) in enumerate(zip(self.shown, digests, strict=False)) if a != b),
                min(len(self.shown), len(digests)),
            )
            notice.append(
                f"(the run resumed from a checkpoint: its {self.name} from record {kept + 1} on come again)"
            )
            del self.shown[kept:]
            records, digests = records[kept:], digests[kept:]
        elif self.shown:
            records, digests = records[1:], digests[1:]
        self.shown += digests
        return notice + [self.line(r) for r in records]


def _digest(record: dict) -> bytes:
    return hashlib.blake2b(json.dumps(record, sort_keys=True).encode(), digest_size=8).digest()
