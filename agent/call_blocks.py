"""Finding the ``<use_mcp_tool>`` blocks of a message, in time linear in its length.

A block reads as MiroFlow's regex reads a well-formed one (``agent.toolcall``)::

    <use_mcp_tool> <server_name>S</server_name> <tool_name>T</tool_name> <arguments> A </arguments> </use_mcp_tool>

with any whitespace between the tags. The regex's lazy groups cannot be used as they stand: in a
block that does not close, each one backtracks across every later closing tag, so a message that
repeats an unclosed call (how a small policy degenerates) took seconds to hours per turn, on the
rollout's event loop, with every trajectory in flight waiting. Here every part's end is found
once:

- a name ends at the first ``</server_name>`` (``</tool_name>``) within ``MAX_NAME`` characters:
  no tool's name is longer, and the bound keeps a run of unclosed openings from rescanning the
  message once per opening;
- the arguments run to the first ``</arguments>`` that whitespace and ``</use_mcp_tool>`` follow
  (as the regex's lazy group reads them: arguments may spell either tag themselves); every such
  place in the message is found once, and each opening's end is a bisection among them;
- a block cut off at the end of the message (generation stopped) is the first opening after the
  last complete block whose names and ``<arguments>`` can be read: its arguments run to the end,
  any closing tags there taken off.

Where a block does not close, the regex could stretch a name across later tags into garbage
("S</server_name> ... <server_name>S2"); this reads the next opening on its own instead.
"""

from __future__ import annotations

import bisect
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
        self._ends: tuple[list[int], list[int]] | None = None

    def ends(self) -> tuple[list[int], list[int]]:
        """Every place a block can end, in order: each CLOSE that follows ``</arguments>`` and
        whitespace only, as (where that ``</arguments>`` starts, where the CLOSE ends). Found once
        for the message, so every opening's search for its end is a bisection."""
        if self._ends is None:
            args_at, ends = [], []
            for m in re.finditer(re.escape(CLOSE), self.text):
                q = m.start()
                while q > 0 and self.text[q - 1].isspace():
                    q -= 1
                if self.text.endswith(_ARGS_CLOSE, 0, q):
                    args_at.append(q - len(_ARGS_CLOSE))
                    ends.append(m.end())
            self._ends = (args_at, ends)
        return self._ends

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
        """The whole block opening at ``p``, if it closes: its arguments run to the first
        ``</arguments>`` that whitespace and CLOSE follow, as the regex's lazy group does."""
        head = self.header(p)
        if head is None:
            return None
        args_at, ends = self.ends()
        k = bisect.bisect_left(args_at, head[2])
        if k == len(args_at):
            return None
        return Block(head[0], head[1], self.text[head[2] : args_at[k]], ends[k])

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
