"""Links that would leak benchmark answers (dataset pages, a benchmark's own site): dropped from
search results and refused as pages to read (``PBSD_TOOLS_BLOCKED_RESULT_HOSTS``).

An entry is matched as a substring of the link as written and of its canonical form: the host in
lower case, without its port, its trailing dot or its user part, IDNA-encoded; the path
percent-decoded, its repeated slashes and dot segments folded. A plain substring test of the link
as written let ``huggingface.co:443/datasets``, ``huggingface.co./datasets``,
``huggingface.co/%64atasets`` and ``huggingface.co//datasets`` through, and each names the page
the entry means.
"""

from __future__ import annotations

import contextlib
import posixpath
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = ["Blocklist", "canonical_link"]

_SLASHES = re.compile(r"/{2,}")
MAX_STRINGS = 1000  # strings looked at in one answer box: a box is a few dozen


def canonical_link(link: str) -> str:
    """``host/path?query`` of ``link``, in the form two spellings of one page share."""
    text = link.strip().lower()
    if "://" not in text:
        text = "http://" + text.lstrip("/")
    try:
        parts = urlsplit(text)
        host = (parts.hostname or "").rstrip(".")
    except ValueError:  # an invalid port or IPv6 literal: the link as written is all there is
        return text
    with contextlib.suppress(UnicodeError):  # a host IDNA refuses stays as written
        host = host.encode("idna").decode("ascii")
    path = parts.path
    for _ in range(3):  # %2564 is %64 is d
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    path = posixpath.normpath(_SLASHES.sub("/", path)) if path else ""
    query = unquote(parts.query)
    # in lower case once decoded too: %42rowse%43omp is BrowseComp
    return (host + (path if path not in (".", "/") else "") + (f"?{query}" if query else "")).lower()


class Blocklist:
    def __init__(self, entries: Iterable[str]) -> None:
        self.entries = tuple(e.lower() for e in entries if e)

    def blocks(self, link: str) -> bool:
        if not self.entries:
            return False
        written, canonical = link.lower(), canonical_link(link)
        return any(e in written or e in canonical for e in self.entries)

    def blocks_any(self, value: Any) -> bool:
        """Whether any string in ``value`` (an answer box, nested as it comes) is blocked."""
        stack, seen = [value], 0
        while stack and seen < MAX_STRINGS:
            item = stack.pop()
            if isinstance(item, str):
                seen += 1
                if self.blocks(item):
                    return True
            elif isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
        return bool(stack)  # past the bound: kept out, as a box no one looked at in full
