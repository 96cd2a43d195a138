"""HTML to readable text in one linear pass: visible text, block elements as line breaks,
scripts, styles and navigation chrome dropped, character references decoded.

Pages are whatever a URL the agent picked returns, so the cost must be linear in the page
whatever its content. The standard library's ``HTMLParser`` is not: it rescans the rest
of the document at every unterminated construct (``"<a" * 80000``, 160 KB, takes tens of
seconds) and raises on some malformed input (``<![ x``). Here every search for a
terminator (``>``, ``-->``, ``</script``) remembers where it found the next one, or that
there is none, so no character is scanned more than a constant number of times.

A tag ends at the first ``>``, even inside a quoted attribute value (browsers read on to
the closing quote): such a tag leaks the rest of its attributes as text, which costs a
summary nothing, while following quotes would bring back the rescanning. Title text runs to
``</title>`` or the next tag, so a page that never closes its title keeps its text.
"""

from __future__ import annotations

import html
import re
import string

__all__ = ["html_to_text"]

_SKIP = frozenset({"script", "style", "noscript", "template", "svg", "head", "nav", "footer", "iframe"})
# elements whose content is raw text up to their closing tag, as ``html.parser`` reads them
_RAW = frozenset({"script", "style"})
_BLOCK = frozenset(
    {
        "p",
        "div",
        "br",
        "li",
        "ul",
        "ol",
        "tr",
        "table",
        "section",
        "article",
        "header",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "blockquote",
        "pre",
        "dd",
        "dt",
        "main",
        "aside",
        "figure",
        "figcaption",
    }
)
# A tag name stops at whitespace, "/", ">" and "<": names never overlap, so matching them all is linear.
_NAME = re.compile(r"[a-zA-Z][^\t\n\f\r /><]*")
_SPACES = re.compile(r"[ \t\r\f\v]+")
_BLANK_LINES = re.compile(r"\n{3,}")
# Markup is ASCII, so only ASCII letters are folded: str.lower() would lengthen some characters
# ("\u0130" becomes two), shifting every position after them between the two copies of the page.
_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


class _Reader:
    def __init__(self, document: str) -> None:
        self.doc = document
        self.lower = document.translate(_ASCII_LOWER)
        self.n = len(document)
        self.next: dict[str, int] = {}  # needle -> where it occurs next (n: nowhere further)
        self.parts: list[str] = []
        self.title: list[str] = []
        self.skip = 0  # depth inside elements whose content is dropped
        self.in_title = False

    def find(self, needle: str, start: int) -> int:
        """Where ``needle`` occurs from ``start`` on (case-insensitively), or ``n``. Every caller's
        ``start`` lies at or after the last one's, so a remembered position is still the next one
        until it falls behind ``start``, and a needle found nowhere is never searched for again."""
        at = self.next.get(needle)
        if at is None or at < start:
            at = self.lower.find(needle, start)
            at = self.n if at == -1 else at
            self.next[needle] = at
        return at

    def read(self) -> tuple[str, str]:
        i = 0
        while i < self.n:
            lt = self.find("<", i)
            self.text(i, lt)
            i = self.markup(lt) if lt < self.n else lt
        text = "".join(self.parts)
        lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
        text = _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()
        return " ".join("".join(self.title).split()), text

    def text(self, start: int, end: int) -> None:
        if end <= start:
            return
        if self.in_title:
            self.title.append(html.unescape(self.doc[start:end]))
        elif not self.skip:
            self.parts.append(html.unescape(self.doc[start:end]))

    def markup(self, lt: int) -> int:
        """Read the markup opening at ``lt``; returns where text resumes."""
        doc = self.doc
        if doc.startswith("<!--", lt):
            return self.find("-->", lt + 4) + 3
        if self.lower.startswith("<![cdata[", lt):
            end = self.find("]]>", lt + 9)
            if not self.skip:
                self.parts.append(doc[lt + 9 : end])
            return end + 3
        closing = doc.startswith("</", lt)
        name = _NAME.match(doc, lt + 2 if closing else lt + 1)
        if name is None:
            if closing or doc.startswith(("<!", "<?"), lt):  # a doctype or a bogus comment: up to ">"
                return self.find(">", lt + 2) + 1
            self.text(lt, lt + 1)  # "a < b": a plain "<"
            return lt + 1
        end = self.find(">", name.end())
        if end >= self.n:  # a tag cut off by the end of the page: nothing of it is visible
            return self.n
        tag = name.group().translate(_ASCII_LOWER)
        # a title holds text only: any other tag ends it, so a title left open keeps no page text
        self.in_title = tag == "title" and not closing and doc[end - 1] != "/"
        if tag == "title":
            return end + 1
        if closing:
            if tag in _SKIP:
                self.skip = max(0, self.skip - 1)
            elif tag in _BLOCK:
                self.parts.append("\n")
            return end + 1
        if doc[end - 1] == "/":  # self-closing: opens nothing
            if tag in _BLOCK:
                self.parts.append("\n")
            return end + 1
        if tag in _SKIP:
            self.skip += 1
        elif tag in _BLOCK:
            self.parts.append("\n")
        if tag in _RAW:  # no markup inside: straight to the closing tag (the content is dropped)
            return self.find("</" + tag, end + 1)
        return end + 1


def html_to_text(document: str) -> tuple[str, str]:
    """(title, text) of an HTML document, in time linear in its length."""
    return _Reader(document).read()
