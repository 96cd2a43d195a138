"""A trajectory's turns as text: what the assistant wrote in each turn and the tool result after it.

The trajectory keeps tokens (what the trainer needs); the credit viewer and the evaluation read
text. The glue after turn ``k`` runs to the start of turn ``k + 1`` (or the end) and is the tool
result inside the chat format's markers (:meth:`agent.chat.ChatFormat.unglue` takes it out).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agent.chat import ChatTokenizer

__all__ = ["turn_texts"]


def turn_texts(
    completion_ids: np.ndarray | Sequence[int],
    turn_spans: Sequence[tuple[int, int]],
    tokenizer: ChatTokenizer,
) -> list[tuple[str, str]]:
    """``[(assistant text, following tool result or "")]``, one per turn."""
    ids = np.asarray(completion_ids).tolist()
    out = []
    for k, (start, end) in enumerate(turn_spans):
        stop = turn_spans[k + 1][0] if k + 1 < len(turn_spans) else len(ids)
        out.append(
            (
                tokenizer.decode(ids[start:end], skip_special_tokens=True),
                tokenizer.fmt.unglue(tokenizer.decode(ids[end:stop])),
            )
        )
    return out
