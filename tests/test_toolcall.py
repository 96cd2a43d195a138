"""The <use_mcp_tool> format: parsing, repair, writing, results; and the system prompt."""

from __future__ import annotations

import json

import msgpack
import pytest

from agent.catalogue import catalogue
from agent.prompt import system_prompt
from agent.toolcall import (
    format_tool_call,
    format_tool_failure,
    format_tool_result,
    parse_tool_call,
    parse_tool_calls,
)
from proto.base import encode
from proto.messages import ToolCall

CALL = """I should search.

<use_mcp_tool>
<server_name>search_and_scrape_webpage</server_name>
<tool_name>google_search</tool_name>
<arguments>
{"q": "the \\"Glass\\" Orchard", "num": 5}
</arguments>
</use_mcp_tool>"""


def test_parse_a_well_formed_call():
    p = parse_tool_call(CALL)
    assert p.error is None and p.count == 1
    assert (p.call.server_name, p.call.tool_name) == ("search_and_scrape_webpage", "google_search")
    assert p.call.arguments == {"q": 'the "Glass" Orchard', "num": 5} and not p.call.repaired


def test_round_trip_through_the_writer():
    text = format_tool_call("s", "t", {"url": "kb://x", "info_to_extract": 'say "hi" {}'})
    p = parse_tool_call(f"thinking...\n\n{text}")
    assert p.call.arguments == {"url": "kb://x", "info_to_extract": 'say "hi" {}'} and not p.call.repaired


@pytest.mark.parametrize(
    "args",
    [
        '{"q": "orchard", "num": 5',  # missing brace
        '{"q": "orchard, "num": 5}',  # missing quote
        "{'q': 'orchard', 'num': 5}",  # single quotes
    ],
)
def test_recoverable_arguments_are_repaired(args):
    p = parse_tool_call(
        f"<use_mcp_tool>\n<server_name>s</server_name>\n<tool_name>t</tool_name>\n<arguments>\n{args}\n</arguments>\n</use_mcp_tool>"
    )
    assert p.call is not None and p.call.repaired
    assert p.call.arguments["q"].startswith("orchard")


def test_missing_closing_tags_at_the_end_are_recovered():
    p = parse_tool_call(
        '<use_mcp_tool>\n<server_name>s</server_name>\n<tool_name>t</tool_name>\n<arguments>\n{"q": "x"}\n'
    )
    assert p.call is not None and p.call.repaired and p.call.arguments == {"q": "x"}


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<use_mcp_tool><tool_name>t</tool_name></use_mcp_tool>", "malformed"),
        (
            "<use_mcp_tool>\n<server_name> </server_name>\n<tool_name>t</tool_name>\n<arguments>{}</arguments>\n</use_mcp_tool>",
            "must not be empty",
        ),
        (
            '<use_mcp_tool>\n<server_name>s</server_name>\n<tool_name>t</tool_name>\n<arguments>["a"]</arguments>\n</use_mcp_tool>',
            "JSON object",
        ),
    ],
)
def test_unrecoverable_calls_are_errors(text, error):
    p = parse_tool_call(text)
    assert p.call is None and error in p.error
    # names that could be read go into the failure the agent is shown, as MiroFlow names them
    assert p.names == (("s", "t") if error == "JSON object" else None)


def test_a_lone_surrogate_in_the_arguments_is_an_unusable_call():
    """It would pass the parser and fail every later encode (the published group, the bus): the whole
    group would be sampled again and again, then dead-lettered."""
    p = parse_tool_call(CALL.replace('"num": 5', '"num": 5, "gl": "\\ud800"'))
    assert (
        p.call is None
        and "surrogate" in p.error
        and p.names == ("search_and_scrape_webpage", "google_search")
    )


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ('"num": 100000000000000000000', "too large"),  # past msgpack's 2^64
        ('"num": -9223372036854775809', "too large"),
        ('"num": NaN', "NaN or Infinity"),  # Python's json reads them; the viewer's JSON.parse does not
        ('"num": 1e999', "NaN or Infinity"),
        ('"num": -Infinity', "NaN or Infinity"),
        ('"num": ' + "[" * 40 + "]" * 40, "nest more than 32"),
        ('"num": ' + "[" * 100_000 + "]" * 100_000, "nest more than 32"),  # json's own recursion
    ],
)
def test_arguments_no_message_can_carry_make_an_unusable_call(arguments, error):
    """A trajectory holding them could not be published (msgpack's integers end at 2^64), so its whole
    group was sampled again until it was dead-lettered; NaN blanked the credit viewer's page; deep
    nesting raised RecursionError in every reader of the turn (the scorer's sorting of turns)."""
    p = parse_tool_call(CALL.replace('"num": 5', arguments))
    assert p.call is None and error in p.error and p.names == ("search_and_scrape_webpage", "google_search")


def test_a_call_cut_off_deep_inside_its_arguments_is_unusable_not_a_crash():
    cut = CALL[: CALL.index("{")] + '{"q": ' + "[" * 100_000  # the token limit reached mid-nesting
    assert parse_tool_call(cut).call is None


def test_arguments_at_the_edge_of_what_a_message_carries_pass_and_encode():
    edge = {"num": 2**64 - 1, "start": -(2**63), "q": [[["deep"]]]}
    p = parse_tool_call(
        CALL.replace('"num": 5', ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in edge.items()))
    )
    assert p.call.arguments == edge
    call = ToolCall(turn=0, server_name="s", tool_name="t", arguments=p.call.arguments, ok=True)
    assert ToolCall.model_validate(msgpack.unpackb(encode(call), raw=False)) == call


def test_a_null_argument_is_an_argument_not_given():
    """As MiroFlow drops them, so the tool's default applies ({"num": null} would fail the schema)."""
    p = parse_tool_call(CALL.replace('"num": 5', '"num": null'))
    assert p.call.arguments == {"q": 'the "Glass" Orchard'}


def test_no_call_and_several_calls():
    assert parse_tool_call(r"The answer is \boxed{x}").call is None
    assert parse_tool_call(r"The answer is \boxed{x}").error is None
    p = parse_tool_call(CALL + "\n" + CALL.replace("google_search", "other"))
    assert p.count == 2 and p.call.tool_name == "google_search"  # the first one; the agent runs both


def test_no_block_of_a_message_is_dropped_in_silence():
    """A complete call, a malformed block and one cut off at the end: two calls and an error."""
    broken = "<use_mcp_tool><tool_name>x</tool_name></use_mcp_tool>"
    cut = CALL.replace("google_search", "other").removesuffix("\n</arguments>\n</use_mcp_tool>")
    calls = parse_tool_calls(CALL + "\n" + broken + "\n" + cut)
    assert [c.call.tool_name if c.call else c.error for c in calls] == [
        "google_search",
        "other",
        "the <use_mcp_tool> block is malformed: it needs <server_name>, <tool_name> and <arguments>",
    ]
    assert calls[1].call.repaired  # recovered from its cut
    assert parse_tool_calls("no call here") == ()


def test_results_and_failures():
    assert format_tool_result("short") == "short"
    long = format_tool_result("x" * 50, max_chars=10)
    assert long == "x" * 10 + "\n... [Result truncated]"  # MiroFlow's marker
    assert format_tool_failure("srv", "tool", "timeout") == "Tool call to tool on srv failed. Error: timeout"


def test_system_prompt_is_appendix_a_with_the_catalogue():
    text = system_prompt(catalogue(), "2025-06-01")
    assert text.startswith("In this environment you have access to a set of tools")
    assert "Today is: 2025-06-01" in text
    assert '"param2": "value2 \\"escaped string\\""' in text
    assert "\n## Server name: search_and_scrape_webpage\n### Tool name: google_search\nDescription: " in text
    assert "### Tool name: scrape_and_extract_info" in text
    assert text.endswith(
        "Your goal is to provide complete, accurate and well-reasoned answers using additional tools."
    )
    assert "{" not in text.split("Here are the functions")[0].replace('{\n"param1"', "")  # no unfilled fields


def _block(arguments: str) -> str:
    return (
        "<use_mcp_tool>\n<server_name>s</server_name>\n<tool_name>t</tool_name>\n"
        f"<arguments>\n{arguments}\n</arguments>\n</use_mcp_tool>"
    )


def test_broken_arguments_of_exactly_the_repair_budget_are_repaired():
    arguments = '{"q": "' + "x" * 493  # 500 characters, without their closing quote and brace
    assert len(arguments) == 500
    (parsed,) = parse_tool_calls(_block(arguments))
    assert parsed.call is not None and parsed.call.repaired


def test_every_malformed_block_is_a_failed_call_of_its_own():
    """The agent is told of each, as of each call it made."""
    bad = "<use_mcp_tool><tool_name>t</tool_name></use_mcp_tool>"
    parsed = parse_tool_calls(bad + "\n" + bad)
    assert len(parsed) == 2 and all(p.call is None and "malformed" in p.error for p in parsed)


def test_a_result_of_exactly_the_limit_is_not_cut():
    assert format_tool_result("x" * 10, max_chars=10) == "x" * 10
    assert format_tool_result("x" * 11, max_chars=10) == "x" * 10 + "\n... [Result truncated]"
