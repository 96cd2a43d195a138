"""Token-exact chat: the conversation is built by appending token ids, never by re-rendering.

A trajectory's ids are, in order::

    encode(prompt)                      system + question + "<|im_start|>assistant\\n"   (mask 0)
    engine output of turn 1             exactly what the engine sampled, stop token included (mask 1)
    encode(glue(tool result 1))         "\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n" (mask 0)
    engine output of turn 2             ...

Each piece is tokenised once, on its own, and the pieces only meet at special tokens
(atomic), so the concatenation is what the model saw and ``decode(ids)`` is the
conversation's ChatML text. Re-rendering the history through a chat template would
not be: Qwen3's template, for one, drops earlier turns' ``<think>`` blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase

__all__ = ["CHATML", "ChatFormat", "ChatTokenizer", "occurrences", "spelled_at"]


@dataclass(frozen=True)
class ChatFormat:
    """The literal text around messages (ChatML, as Qwen models use it)."""

    start: str = "<|im_start|>"
    end: str = "<|im_end|>"

    def message(self, role: str, content: str) -> str:
        return _text(self._message(role, content))

    def prompt(self, system: str, user: str) -> str:
        """The first context: system and user messages, then the opening of the assistant's turn."""
        return _text(self.prompt_parts(system, user))

    def glue(self, tool_result: str, *, closed: bool) -> str:
        """What follows an assistant turn: the tool result as a user message, then the next turn's opening.
        ``closed``: the assistant turn already ended with the end token (its usual stop token)."""
        return _text(self.glue_parts(tool_result, closed=closed))

    # The same texts as pieces ``(text, is_content)``: content is what a message says (a question, a
    # tool result), the rest is the format's own markup. A tokenizer encodes them apart, so content
    # can never become a marker.
    def _message(self, role: str, content: str) -> list[tuple[str, bool]]:
        return [(f"{self.start}{role}\n", False), (content, True), (f"{self.end}\n", False)]

    def prompt_parts(self, system: str, user: str) -> list[tuple[str, bool]]:
        return [
            *self._message("system", system),
            *self._message("user", user),
            (f"{self.start}assistant\n", False),
        ]

    def glue_parts(self, tool_result: str, *, closed: bool) -> list[tuple[str, bool]]:
        close = "\n" if closed else f"{self.end}\n"
        return [(close, False), *self._message("user", tool_result), (f"{self.start}assistant\n", False)]

    def unglue(self, text: str) -> str:
        """The tool result inside ``text`` decoded from glue (the inverse of :meth:`glue`); "" if none."""
        head = f"{self.start}user\n"
        i = text.find(head)
        if i < 0:
            return ""
        body = text[i + len(head) :]
        tail = body.rfind(self.end)  # cut before a trajectory ended, the result may be unclosed
        return body[:tail] if tail >= 0 else body


def _text(parts: list[tuple[str, bool]]) -> str:
    return "".join(text for text, _ in parts)


CHATML = ChatFormat()


def _fast_ids(backend: Tokenizer, text: str) -> list[int]:
    return backend.encode_batch_fast([text], add_special_tokens=False)[0].ids


def _plain(backend) -> bool:
    """A ``tokenizers`` object the Hugging Face wrapper would call as it is (no truncation or
    padding configured on it)."""
    return isinstance(backend, Tokenizer) and backend.truncation is None and backend.padding is None


class ChatTokenizer:
    """A Hugging Face tokenizer plus the chat format, with the stop tokens of an assistant turn.

    Every turn of every trajectory encodes a tool result and decodes a message, so a fast
    tokenizer is called directly (the ``tokenizers`` object under the Hugging Face wrapper: the
    same ids without the wrapper's per-call bookkeeping), through ``encode_batch_fast`` (the same
    ids again, without the character offsets that ``encode`` tracks through pre-tokenisation: 30%
    of a tool result's encoding), and the pieces that repeat (the format's markup, the system
    prompt) are encoded once."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, fmt: ChatFormat = CHATML, *, eos_ids: tuple[int, ...] = ()
    ) -> None:
        self.tok = tokenizer
        self.fmt = fmt
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._markup_backend = backend if _plain(backend) else None
        self._content_backend = None
        if self._markup_backend is not None:
            # a twin that reads special tokens written in text as characters (split_special_tokens)
            self._content_backend = Tokenizer.from_str(backend.to_str())
            self._content_backend.encode_special_tokens = True
        self._decodes_plainly = self._markup_backend is not None and not getattr(
            tokenizer, "clean_up_tokenization_spaces", False
        )
        self._markup: dict[str, list[int]] = {}  # the format's few fixed strings
        self._system: tuple[str, list[int]] = ("", [])  # the last system prompt encoded
        self.end_id = self._single_id(fmt.end)
        # the turn's end, and every end of text the model knows: SGLang stops on the model's own
        # (generation_config's) eos ids whatever it is asked, so the in-process engine does too
        stops = {self.end_id, *eos_ids}
        if tokenizer.eos_token_id is not None:
            stops.add(int(tokenizer.eos_token_id))
        self.stop_ids = sorted(stops)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ChatTokenizer:
        return cls(AutoTokenizer.from_pretrained(str(path)), eos_ids=generation_eos_ids(path))

    def ends_text(self, ids: list[int]) -> bool:
        """A turn that stopped on an end of text other than the turn's end (Qwen3's <|endoftext|>):
        the model has finished, and no format's glue follows it."""
        return bool(ids) and ids[-1] != self.end_id and ids[-1] in self.stop_ids

    def _single_id(self, token: str) -> int:
        ids = self.tok.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"{token!r} must be one special token of the tokenizer, got ids {ids}")
        return ids[0]

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; special tokens written in it (``<|im_start|>``) become their ids."""
        if self._markup_backend is not None:
            return _fast_ids(self._markup_backend, text)
        return self.tok.encode(text, add_special_tokens=False)

    def encode_text(self, text: str) -> list[int]:
        """Ids of message content: a special token written in it (a web page quoting
        ``<|im_end|>``) stays characters, so no content can forge a turn or role boundary."""
        if self._content_backend is not None:
            return _fast_ids(self._content_backend, text)
        return self.tok.encode(text, add_special_tokens=False, split_special_tokens=True)

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        if self._decodes_plainly:
            return self._markup_backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def spellings(self, text: str) -> set[tuple[int, ...]]:
        """The ids ``text`` has in running prose: as it is and after a space, without any leading token
        that is only whitespace (a name's space is not the name; tokenizers split it off or not)."""
        out = set()
        for variant in (text, " " + text):
            ids = self.encode(variant)
            while ids and not self.decode(ids[:1]).strip():
                ids = ids[1:]
            out.add(tuple(ids))
        return out - {()}

    def prompt_ids(self, system: str, user: str) -> list[int]:
        if self._system[0] != system:  # a run's trajectories share their system prompt
            self._system = (system, self.encode_text(system))
        ids: list[int] = []
        for text, content in self.fmt.prompt_parts(system, user):
            if content and text == system:
                ids += self._system[1]
            else:
                ids += self._encode_part(text, content)
        return ids

    def glue_ids(self, tool_result: str, *, closed: bool) -> list[int]:
        return self._encode_parts(self.fmt.glue_parts(tool_result, closed=closed))

    def _encode_parts(self, parts: list[tuple[str, bool]]) -> list[int]:
        """Markup with its special tokens, content as text. The pieces meet at special tokens or a
        newline, so for content without markers this is the ids of the whole text."""
        ids: list[int] = []
        for text, content in parts:
            ids += self._encode_part(text, content)
        return ids

    def _encode_part(self, text: str, content: bool) -> list[int]:
        if content:
            return self.encode_text(text)
        ids = self._markup.get(text)
        if ids is None:
            ids = self._markup[text] = self.encode(text)
        return ids

    @property
    def vocab_size(self) -> int:
        return len(self.tok)


def occurrences(ids, spellings) -> list[tuple[int, int]]:
    """(start, length) of every whole occurrence in ``ids`` of any of ``spellings`` (token sequences,
    e.g. :meth:`ChatTokenizer.spellings`), in order of start."""
    arr = np.asarray(ids)
    out = []
    for spelling in filter(None, spellings):
        n = arr.size - len(spelling) + 1
        if n <= 0:
            continue
        hit = np.ones(n, dtype=bool)
        for i, token in enumerate(spelling):
            hit &= arr[i : i + n] == token
        out += [(int(p), len(spelling)) for p in np.flatnonzero(hit)]
    return sorted(out)


def spelled_at(ids, spellings) -> list[int]:
    """Indices of ``ids`` inside a whole occurrence of any of ``spellings`` (token sequences)."""
    return sorted({k for start, n in occurrences(ids, spellings) for k in range(start, start + n)})


def generation_eos_ids(path: str | Path) -> tuple[int, ...]:
    """The eos ids of a checkpoint's ``generation_config.json`` (an id or a list; Qwen3's are
    <|im_end|> and <|endoftext|>), none when it has no such file."""
    config = Path(path) / "generation_config.json"
    if not config.is_file():
        return ()
    eos = json.loads(config.read_text()).get("eos_token_id")
    return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None)
