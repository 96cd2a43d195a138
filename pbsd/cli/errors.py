"""User errors on the command line: one line on stderr and a non-zero exit, never a traceback.

Every command runs inside :class:`Group`, the root app's click group, so a command only
raises; :func:`describe` decides what a user caused and says it in one line:

- :class:`UserError`: what went wrong and what to do about it, said by the command (exit 1);
- click's own errors, ``typer.BadParameter`` among them: misuse of an option (exit 2);
- an ``OSError`` about a named path (missing, a directory, not permitted) (exit 1);
- an httpx or aiohttp (the tool gateway's client) transport error or HTTP error status: a
  service that does not answer, or answers with an error (exit 1).

Anything else is a bug and keeps its traceback, for the bug report.
"""

from __future__ import annotations

import errno
import sys

import typer
from typer.core import TyperGroup

__all__ = ["Group", "UserError", "describe", "problems", "raise_if_failed"]

# click's exceptions, as typer raises them (recent typer versions carry their own copy of click)
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
_NoArgsIsHelpError = getattr(sys.modules[_UsageError.__module__], "NoArgsIsHelpError", ())

# the OSErrors a path given on the command line causes; others (a full disk, EPIPE) are not ours
_PATH_ERRNOS = {errno.ENOENT, errno.EISDIR, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EEXIST}


class UserError(Exception):
    """Something the user can fix; the message says what and how."""

    def __init__(self, message: str, *, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def problems(exc: Exception) -> str:
    """A pydantic ValidationError's errors in one line: each field's dotted place, then what is wrong
    (a model-wide check has no place, and says its own)."""
    return "; ".join(
        (f"{'.'.join(map(str, e['loc']))}: " if e["loc"] else "") + e["msg"].removeprefix("Value error, ")
        for e in exc.errors()  # type: ignore[attr-defined]
    )


def raise_if_failed(finish_reasons: dict[str, int], report: object) -> None:
    """Exit 1 when any trajectory ended in an error (no server answered, the engine failed): the
    report is written, but its accuracy counts those trajectories wrong, so it is not a result."""
    failed = finish_reasons.get("error", 0)
    if failed:
        total = sum(finish_reasons.values())
        raise UserError(
            f"{failed} of {total} trajectories failed (the log above says why); {report} counts them wrong"
        )


def describe(exc: BaseException) -> tuple[str, int] | None:
    """One line and an exit code for an error a user's input causes; None for any other."""
    if isinstance(exc, UserError):
        return _line(str(exc)), exc.code
    if isinstance(exc, _NoArgsIsHelpError):  # shows the help: not an error
        return None
    if isinstance(exc, _ClickException):
        hint = ""
        ctx = getattr(exc, "ctx", None)
        if isinstance(exc, _UsageError) and ctx is not None:
            hint = f" (see `{ctx.command_path} --help`)"
        return _line(exc.format_message()) + hint, exc.exit_code
    if isinstance(exc, OSError) and exc.filename is not None and exc.errno in _PATH_ERRNOS:
        return f"{exc.filename}: {exc.strerror}", 1
    httpx = sys.modules.get("httpx")  # not imported: the error cannot be one of its own
    if httpx is not None and isinstance(exc, httpx.HTTPStatusError):
        return f"{exc.request.url} answered HTTP {exc.response.status_code}", 1
    if httpx is not None and isinstance(exc, httpx.TransportError):
        return f"cannot reach {request_url(exc)}: {transport_reason(exc)}", 1
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(exc, aiohttp.ClientResponseError):
        return f"{exc.request_info.real_url} answered HTTP {exc.status}", 1
    if aiohttp is not None and isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot reach {exc.host}:{exc.port}: connection failed ({_line(str(exc.os_error))})", 1
    if aiohttp is not None and isinstance(exc, aiohttp.ClientError):
        return f"cannot reach the service: {_line(str(exc)) or type(exc).__name__}", 1
    return None


def request_url(exc: BaseException) -> str:
    """The URL an httpx error was about, or "the service" when it names none."""
    try:
        return str(exc.request.url)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # httpx raises RuntimeError for an error without a request
        return "the service"


def transport_reason(exc: BaseException) -> str:
    """A transport error in a few words: httpx's message is often empty or a nested repr."""
    import httpx

    if isinstance(exc, httpx.ConnectError):
        return f"connection failed ({_line(str(exc)) or 'refused'})"
    if isinstance(exc, httpx.TimeoutException):
        return "no answer in time"
    if isinstance(exc, (httpx.UnsupportedProtocol, httpx.InvalidURL)):
        return f"not a usable URL ({_line(str(exc))})"
    return _line(str(exc)) or type(exc).__name__


def _line(text: str) -> str:
    return " ".join(text.split())


class Group(TyperGroup):
    """The root command group: runs every command with :func:`describe`'s errors as one line."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except Exception as exc:
            said = describe(exc)
            if said is None:
                raise
            message, code = said
            typer.echo(f"error: {message}", err=True)
            raise typer.Exit(code) from None
