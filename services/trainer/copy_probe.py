"""Can the policy copy? Teacher-forced greedy accuracy on the spans a search agent must copy.

A warm start can reach a low SFT loss and still fail every episode, because what an episode
hinges on is a handful of tokens: the name put into a search query, the URL handed to the
reader, the name in ``\\boxed{}``. Given the oracle's conversation up to each of those spans,
this asks whether greedy decoding would write the span exactly (every token the argmax). One
forward pass per conversation, so it measures a checkpoint in seconds, not the minutes of a
sampled evaluation, and it says which skill is missing.

The request (what the agent asks the reader to extract from a page, e.g. "Who founded X?") is
probed too: it is where the agent picks the question's next relation, so a policy that copies
names well but follows the wrong chain shows there.

An episode needs every one of its spans right, so accuracies multiply: a two-hop question has
about seven (two queries, two URLs, two requests, one answer), and at 0.7 each it succeeds about
8% of the time under greedy decoding; sampling at temperature 1 does worse.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import torch

from agent.chat import ChatTokenizer
from services.model.checkpoint import load_model
from services.trainer.sft import encode_conversation

__all__ = ["SPANS", "copy_probe"]

SPANS = {
    "query": re.compile(r'"q": "([^"]*)"'),
    "url": re.compile(r'"url": "([^"]*)"'),
    "request": re.compile(r'"info_to_extract": "([^"]*)"'),
    "answer": re.compile(r"\\boxed\{([^}]*)\}"),
}


def copy_probe(model_dir: Path, data: Path, *, limit: int | None = None) -> dict[str, dict[str, float]]:
    """{span kind: {"right", "total", "accuracy"}} over the assistant messages of ``data`` (chat JSONL)."""
    tok = ChatTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir)
    right = dict.fromkeys(SPANS, 0)
    total = dict.fromkeys(SPANS, 0)
    with data.open(encoding="utf-8") as f:  # parse only the conversations probed
        rows = [json.loads(line) for line in itertools.islice(filter(str.strip, f), limit)]
    for row in rows:
        ids, mask = encode_conversation(tok, row["messages"])
        with torch.no_grad():
            pred = model(torch.tensor([ids])).logits[0, :-1].argmax(-1).tolist()
        # each assistant message starts where the loss mask turns on (the prompt before it is 0s)
        starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
        for start, message in zip(starts, row["messages"][2::2], strict=True):
            text = message["content"]
            offsets = tok.tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            for kind, pattern in SPANS.items():
                for m in pattern.finditer(text):
                    a, b = m.span(1)
                    tokens = [k for k, (s, e) in enumerate(offsets) if s < b and e > a]
                    # pred[p] is the prediction for ids[p + 1]
                    right[kind] += all(pred[start + k - 1] == ids[start + k] for k in tokens)
                    total[kind] += 1
    return {
        k: {"right": right[k], "total": total[k], "accuracy": right[k] / total[k] if total[k] else 0.0}
        for k in SPANS
    }
