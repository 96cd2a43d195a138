"""Finding the ``<use_mcp_tool>`` blocks of a message, in time linear in its length.

A block reads as MiroFlow's regex reads a well-formed one (``agent.toolcall``)::

    <use_mcp_tool> <server_name>S</server_name> <tool_name>T</tool_name> <arguments> A </arguments> </use_mcp_tool>

with any whitespace between the tags. The regex's lazy groups cannot be used as they stand: in a
block that does not close, each one backtracks across every later closing tag, so a message that
repeats an unclosed call (how a small policy degenerates) took seconds to hours per turn, on the
rollout's event loop, with every trajectory in flight waiting. Here each part ends at its first
closing tag, found once:

- a name ends at the first ``</server_name>`` (``</tool_name>``) within ``MAX_NAME`` characters:
  no tool's name is longer, and the bound keeps a run of unclosed openings from rescanning the
  message once per opening;
- the arguments run to the block's first ``</use_mcp_tool>``, which must follow ``</arguments>``
  and whitespace only (arguments that spell ``</arguments>`` themselves keep it);
- a block cut off at the end of the message (generation stopped) is the first opening after the
  last complete block whose names and ``<arguments>`` can be read: its arguments run to the end,
  any closing tags there taken off.

Where a block does not close, the regex could stretch a name across later tags into garbage
("S</server_name> ... <server_name>S2"); this reads the next opening on its own instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["MAX_NAME", "OPEN", "Block", "blocks"]

OPEN, CLOSE = "<use_mcp_tool>", "</use_mcp_tool>"
_ARGS_OPEN, _ARGS_CLOSE = "<arguments>", "</arguments>"
MAX_NAME = 256  # characters: longer is no name a tool has
_WS = re.compile(r"\s*")


@dataclass(frozen=True)
class Block:
    server: str
    tool: str
    arguments: str  # as written, whitespace around it left for the reader
    end: int  # where the block ends in the message


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self._close: tuple[int, int] = (0, -2)  # (searched from, first CLOSE at or after it)
        self._spaced: dict[int, int] = {}  # a CLOSE's position -> where the whitespace before it starts

    def close_after(self, i: int) -> int:
        """The first CLOSE at or after ``i`` (-1: none). Openings are read left to right, so the one
        found for an earlier position is the answer until ``i`` passes it: each is found once."""
        start, hit = self._close
        if not (start <= i and (hit == -1 or hit >= i)):
            hit = self.text.find(CLOSE, i)
            self._close = (i, hit)
        return hit

    def spaced(self, end: int) -> int:
        """Where the whitespace that runs up to ``end`` starts (openings that fail share a CLOSE:
        each run is walked once)."""
        if end not in self._spaced:
            q = end
            while q > 0 and self.text[q - 1].isspace():
                q -= 1
            self._spaced[end] = q
        return self._spaced[end]

    def tag(self, tag: str, i: int) -> int | None:
        """The position after ``tag`` where it opens at ``i`` (after whitespace), else None."""
        i = _WS.match(self.text, i).end()
        return i + len(tag) if self.text.startswith(tag, i) else None

    def name(self, tag: str, i: int) -> tuple[str, int] | None:
        """``<tag>name</tag>`` at ``i``: the name and the position after its closing tag."""
        start = self.tag(f"<{tag}>", i)
        if start is None:
            return None
        end = self.text.find(f"</{tag}>", start, start + MAX_NAME + len(tag) + 3)
        return None if end == -1 else (self.text[start:end], end + len(tag) + 3)

    def header(self, p: int) -> tuple[str, str, int] | None:
        """Server, tool and where the arguments start, for the opening at ``p``."""
        server = self.name("server_name", p + len(OPEN))
        tool = server and self.name("tool_name", server[1])
        args = tool and self.tag(_ARGS_OPEN, tool[1])
        return None if args is None else (server[0], tool[0], args)

    def complete(self, p: int) -> Block | None:
        """The whole block opening at ``p``, if it closes."""
        head = self.header(p)
        end = -1 if head is None else self.close_after(head[2])
        if end == -1:
            return None
        body_end = max(self.spaced(end), head[2])
        if not self.text.endswith(_ARGS_CLOSE, head[2], body_end):
            return None
        return Block(head[0], head[1], self.text[head[2] : body_end - len(_ARGS_CLOSE)], end + len(CLOSE))

    def cut(self, p: int) -> Block | None:
        """The block opening at ``p`` cut off by the message's end, its closing tags missing."""
        head = self.header(p)
        if head is None:
            return None
        rest = self.text[head[2] :].rstrip()
        for tag in (CLOSE, _ARGS_CLOSE):
            rest = rest.removesuffix(tag).rstrip()
        return Block(head[0], head[1], rest, len(self.text))


def blocks(text: str) -> tuple[list[Block], Block | None, int]:
    """The message's complete blocks in order, the block cut off at its end (None: none), and how
    many other openings form no block."""
    reader, found, unread = _Reader(text), [], []
    p = text.find(OPEN)
    while p != -1:
        block = reader.complete(p)
        if block is None:
            unread.append(p)
            p = text.find(OPEN, p + len(OPEN))
        else:
            found.append(block)
            p = text.find(OPEN, block.end)  # an opening inside the block is part of it
    after = found[-1].end if found else 0
    cut = next((b for q in unread if q >= after and (b := reader.cut(q)) is not None), None)
    return found, cut, text.count(OPEN) - len(found) - (cut is not None)
