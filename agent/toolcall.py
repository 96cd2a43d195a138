r"""The ``<use_mcp_tool>`` call format: parsing (with repair), writing, and tool results.

A call is the block MiroFlow's regex reads (found in linear time by ``agent.call_blocks``)::

    <use_mcp_tool>
    <server_name>...</server_name>
    <tool_name>...</tool_name>
    <arguments>
    {JSON object}
    </arguments>
    </use_mcp_tool>

The system prompt allows one tool per message, but a model may write several blocks: every
one is run, in order, and their results are joined with a newline into the one user message
that answers the turn, as MiroFlow's orchestrator runs them (``parse_tool_calls``; the agent
caps how many). Arguments that are not valid JSON are repaired with ``json_repair`` when the
damage is recoverable (a missing quote or brace), up to ``MAX_REPAIR`` characters a message;
arguments no message can carry (NaN, an integer past 2^64, nesting past 32 levels) make the call
unusable. A block whose closing tags are
missing at the very end of the message (generation stopped early) is recovered too.
Everything else is reported back to the agent as a failed tool call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from json_repair import repair_json

from agent.call_blocks import Block, blocks
from proto.base import unfit_value

__all__ = [
    "Parsed",
    "ToolCallRequest",
    "format_tool_call",
    "format_tool_failure",
    "format_tool_result",
    "parse_tool_call",
    "parse_tool_calls",
]

DEFAULT_MAX_RESULT_CHARS = 100_000  # as MiroFlow cuts tool results


@dataclass(frozen=True)
class ToolCallRequest:
    server_name: str
    tool_name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    repaired: bool = False  # the arguments or the closing tags needed repair


@dataclass(frozen=True)
class Parsed:
    call: ToolCallRequest | None
    error: str | None = None  # set when the message tries to call a tool but the call is unusable
    count: int = 0  # complete call blocks found in the message
    names: tuple[str, str] | None = None  # (server, tool) of an unusable call whose names could be read


# Characters of broken arguments a message may have repaired, over all its calls: json_repair takes
# 0.06 s on 500 characters of nested openings and up to half a second on 1,000 (where it recurses to
# Python's limit), the parse runs on the rollout's event loop, and a message may hold any number
# of calls. Real arguments (a query, an address) are far shorter.
MAX_REPAIR = 500

# Why a call's arguments cannot travel: a trajectory holding an integer msgpack cannot carry could
# not be published (its whole group was sampled again until it was dead-lettered), NaN and Infinity
# blanked the credit viewer's page (its JSON.parse refuses them), and no tool takes nesting this deep.
_MAX_DEPTH = 32
_UNFIT = {
    "not finite": "arguments hold NaN or Infinity, which JSON does not allow",
    "too large": "arguments hold an integer too large to carry",
    "too deep": f"arguments nest more than {_MAX_DEPTH} levels deep",
}


@dataclass
class _Repairs:
    left: int  # characters of broken arguments the message may still have repaired

    def take(self, n: int) -> bool:
        """Spend ``n`` of them, if that many are left."""
        if n > self.left:
            return False
        self.left -= n
        return True


def _arguments(raw: str, budget: _Repairs) -> tuple[dict[str, Any] | None, bool, str | None]:
    """The call's arguments, whether they were repaired, or why they are unusable. ``budget``: the
    characters of repair the message has left, spent here."""
    raw = raw.strip()
    if not raw:
        return {}, False, None
    try:
        value = json.loads(raw)
        repaired = False
    except RecursionError:
        return None, False, _UNFIT["too deep"]
    except ValueError as exc:
        if not isinstance(exc, json.JSONDecodeError):  # an integer past Python's 4,300 digits
            return None, False, _UNFIT["too large"]
        if not budget.take(len(raw)):
            return (
                None,
                False,
                f"arguments are not valid JSON, and past what a message may have repaired ({MAX_REPAIR} characters)",
            )
        try:
            value = repair_json(raw, return_objects=True)
        except Exception as exc:  # json_repair may raise on pathological input (RecursionError too)
            return (
                None,
                False,
                f"arguments are not valid JSON and could not be repaired ({type(exc).__name__})",
            )
        repaired = True
    if not isinstance(value, dict):
        return None, repaired, "arguments must be a JSON object"
    if problem := unfit_value(value, _MAX_DEPTH):
        return None, repaired, _UNFIT[problem]
    try:  # JSON may spell a lone UTF-16 surrogate ("\ud800"), which no message can carry on
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return None, repaired, "arguments hold a lone UTF-16 surrogate, which is not text"
    # a null is an argument not given (as MiroFlow drops them), so the tool's default applies
    return {k: v for k, v in value.items() if v is not None}, repaired, None


def _one(block: Block, count: int, truncated: bool, budget: _Repairs) -> Parsed:
    server, tool = block.server.strip(), block.tool.strip()
    if not server or not tool:
        return Parsed(None, "server_name and tool_name must not be empty", count)
    args, repaired, error = _arguments(block.arguments, budget)
    if error:
        return Parsed(None, error, count, (server, tool))
    return Parsed(ToolCallRequest(server, tool, args, repaired or truncated), None, 0 if truncated else count)


MALFORMED = "the <use_mcp_tool> block is malformed: it needs <server_name>, <tool_name> and <arguments>"


def parse_tool_calls(text: str) -> tuple[Parsed, ...]:
    """Every tool call of an assistant message: the complete blocks in order, then a block cut off
    at the end of the message (recovered where its names and arguments can be read), then one error
    for each other ``<use_mcp_tool>`` that forms no block; () when it makes none. Each is a call, or
    the error that makes it unusable (reported back to the agent as that call's failure)."""
    found, cut, unread = blocks(text)
    budget = _Repairs(MAX_REPAIR)
    calls = [_one(b, len(found), False, budget) for b in found]
    if cut is not None:
        calls.append(_one(cut, 1, True, budget))
    calls += [Parsed(None, MALFORMED, len(found))] * unread
    return tuple(calls)


def parse_tool_call(text: str) -> Parsed:
    """The first tool call of an assistant message, if it makes one (``count``: how many it makes)."""
    calls = parse_tool_calls(text)
    return calls[0] if calls else Parsed(None)


def format_tool_call(server_name: str, tool_name: str, arguments: dict[str, Any]) -> str:
    """A call block exactly as the agent is taught to write it."""
    return (
        "<use_mcp_tool>\n"
        f"<server_name>{server_name}</server_name>\n"
        f"<tool_name>{tool_name}</tool_name>\n"
        "<arguments>\n"
        f"{json.dumps(arguments, ensure_ascii=False)}\n"
        "</arguments>\n"
        "</use_mcp_tool>"
    )


def format_tool_result(result: str, max_chars: int = DEFAULT_MAX_RESULT_CHARS) -> str:
    """A successful tool result as the user message that carries it; long results are cut."""
    if len(result) <= max_chars:
        return result
    return result[:max_chars] + "\n... [Result truncated]"


def format_tool_failure(server_name: str, tool_name: str, error: str) -> str:
    return f"Tool call to {tool_name} on {server_name} failed. Error: {error}"
