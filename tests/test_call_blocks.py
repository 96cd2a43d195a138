"""Finding call blocks (agent/call_blocks.py): as MiroFlow's regex reads a well-formed message, and
in time linear in the message on what a degenerate policy writes (the regex's lazy groups backtrack
across every later tag: minutes a turn, on the rollout's event loop)."""

from __future__ import annotations

import random
import re
import time

import pytest

from agent.call_blocks import blocks
from agent.grounding import urls
from agent.toolcall import MAX_REPAIR, parse_tool_calls
from pbsd.verifier import extract_boxed

# MiroFlow's pattern for a block, and the same block cut off at the end of the message
MIROFLOW = re.compile(
    r"<use_mcp_tool>\s*<server_name>(.*?)</server_name>\s*<tool_name>(.*?)</tool_name>\s*"
    r"<arguments>\s*([\s\S]*?)\s*</arguments>\s*</use_mcp_tool>",
    re.DOTALL,
)
CUT = re.compile(
    r"<use_mcp_tool>\s*<server_name>(.*?)</server_name>\s*<tool_name>(.*?)</tool_name>\s*"
    r"<arguments>\s*([\s\S]*?)\s*(?:</arguments>)?\s*(?:</use_mcp_tool>)?\s*\Z",
    re.DOTALL,
)
BLOCK = (
    "<use_mcp_tool>{w}<server_name>{s}</server_name>{w}<tool_name>{t}</tool_name>{w}<arguments>{w}{a}{w}"
    "</arguments>{w}</use_mcp_tool>"
)


def _message(rng: random.Random) -> str:
    """Prose and well-formed blocks, and perhaps a block cut off anywhere at the end."""
    parts = []
    for _ in range(rng.randint(0, 4)):
        parts.append(rng.choice(["I will search. ", "\n", "", "<b>bold</b> ", "a < b > c "]))
        w = rng.choice(["", "\n", " \n ", "\t"])
        args = rng.choice(
            [
                '{"q": "x"}',
                '{"q": "</arguments>"}',
                '{"q": "</use_mcp_tool>"}',
                '{"q": 1',
                "",
                "[1]",
                "not json",
            ]
        )
        parts.append(
            BLOCK.format(w=w, s=rng.choice(["s", " s ", ""]), t=rng.choice(["t", "google_search"]), a=args)
        )
    if rng.random() < 0.5:
        block = BLOCK.format(w="\n", s="search", t="google_search", a='{"q": "cut"}')
        parts.append(block[: rng.randint(0, len(block))])
    return "".join(parts)


def test_well_formed_messages_read_as_miroflow_reads_them():
    rng = random.Random(0)
    for _ in range(3000):
        text = _message(rng)
        found, cut, unread = blocks(text)
        matches = list(MIROFLOW.finditer(text))
        assert [(b.server, b.tool, b.arguments.strip()) for b in found] == [m.groups() for m in matches]
        tail = CUT.search(text, matches[-1].end() if matches else 0)
        assert (cut is None) == (tail is None)
        if tail is not None:
            assert (cut.server, cut.tool, cut.arguments.strip()) == tail.groups()
        assert unread == text.count("<use_mcp_tool>") - len(matches) - (tail is not None)


H = "<use_mcp_tool><server_name>s</server_name><tool_name>t</tool_name><arguments>"
UNCLOSED = (
    "<use_mcp_tool>\n<server_name>search</server_name>\n<tool_name>google_search</tool_name>\n<arguments>\n"
)


@pytest.mark.parametrize(
    "text",
    [
        H + "{" + " " * 2000 + "}",  # the regex: about 4 minutes at 800 spaces
        H + '{"q": "a"' + " " * 2000 + "}",
        (UNCLOSED + '{"q": "x"}\n</arguments>\n') * 300,  # 2.4 s at 50 repeats
        (H + "{}") * 1000,  # 11.8 s at 100
        H + " " * 4000 + "x",
        "<use_mcp_tool><server_name>" * 4000 + "</server_name>" + " " * 20_000,
    ],
    ids=["cut-spaces", "cut-after-value", "unclosed-repeats", "bare-headers", "header-spaces", "openings"],
)
def test_what_a_degenerate_policy_writes_is_read_in_linear_time(text):
    started = time.perf_counter()
    calls = parse_tool_calls(text)
    assert time.perf_counter() - started < 1.0 and calls  # each is some failed or recovered call


def test_arguments_past_the_digit_limit_or_the_message_repair_budget_are_failed_calls():
    huge = UNCLOSED + '{"q": ' + "1" * 4301 + "}\n</arguments>\n</use_mcp_tool>"
    assert "too large" in parse_tool_calls(huge)[0].error  # json raised ValueError through the agent
    # json_repair took half a second on each block of 990 characters of nested openings, and a
    # message may hold any number of blocks: the repair budget is the message's
    block = H + '{"' * 495 + "</arguments></use_mcp_tool>"
    started = time.perf_counter()
    calls = parse_tool_calls(block * 40)
    assert time.perf_counter() - started < 1.0
    assert all("past what a message may have repaired" in c.error for c in calls)
    small = H + '{"q": "a"</arguments></use_mcp_tool>'  # 9 characters to repair each
    calls = parse_tool_calls(small * (MAX_REPAIR // 9 + 5))
    repaired = [c for c in calls if c.call is not None]
    assert len(repaired) == MAX_REPAIR // 9 and all(c.call.repaired for c in repaired)
    assert all("past what a message may have repaired" in c.error for c in calls[len(repaired) :])


def test_boxes_left_open_and_dotted_runs_are_read_in_linear_time():
    started = time.perf_counter()
    assert extract_boxed("\\boxed{" * 20_000) is None  # 6 s at 4,000 when each box scanned to the end
    assert extract_boxed("\\boxed{" * 20_000 + "x}") == "x"
    page = "a." * 50_000 + " see https://example.org/a.b."
    assert urls(page) == {"https://example.org/a.b"}  # 3 s at 60,000 characters, scheme unbounded
    assert time.perf_counter() - started < 1.0
