"""The search agent's system prompt: the paper's Appendix A, as MiroFlow renders it.

``{formatted_date}`` is ``%Y-%m-%d``. ``{mcp_server_definitions}`` lists each server,
then each of its tools, exactly as MiroFlow's ``generate_mcp_system_prompt`` does::

    \\n## Server name: <server>\\n
    ### Tool name: <tool>\\n
    Description: <description>\\n
    Input JSON schema: <schema>\\n

One deliberate difference: the schema is printed as JSON (MiroFlow prints the Python
dict), since the prompt announces "functions available in JSONSchema format".
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "ANSWER_INSTRUCTION",
    "SYSTEM_PROMPT_TEMPLATE",
    "render_server_definitions",
    "system_prompt",
    "user_prompt",
]

# Appended to the question, as MiroFlow's benchmark tasks do, so the answer can be graded.
ANSWER_INSTRUCTION = "Wrap your final answer in \\boxed{}."

SYSTEM_PROMPT_TEMPLATE = """In this environment you have access to a set of tools you can use to answer the user's question.

You only have access to the tools provided below. You can only use one tool per message, and will receive the result of that tool in the user's next response. You use tools step-by-step to accomplish a given task, with each tool-use informed by the result of the previous tool-use. Today is: {formatted_date}

# Tool-Use Formatting Instructions

Tool-use is formatted using XML-style tags. The tool-use is enclosed in <use_mcp_tool></use_mcp_tool> and each parameter is similarly enclosed within its own set of tags.

The Model Context Protocol (MCP) connects to servers that provide additional tools and resources to extend your capabilities. You can use the server's tools via the `use_mcp_tool`.

Description:
Request to use a tool provided by a MCP server. Each MCP server can provide multiple tools with different capabilities. Tools have defined input schemas that specify required and optional parameters.

Parameters:
- server_name: (required) The name of the MCP server providing the tool
- tool_name: (required) The name of the tool to execute
- arguments: (required) A JSON object containing the tool's input parameters, following the tool's input schema, quotes within string must be properly escaped, ensure it's valid JSON

Usage:
<use_mcp_tool>
<server_name>server name here</server_name>
<tool_name>tool name here</tool_name>
<arguments>
{{
"param1": "value1",
"param2": "value2 \\"escaped string\\""
}}
</arguments>
</use_mcp_tool>

Important Notes:
- Tool-use must be placed **at the end** of your response, **top-level**, and not nested within other tags.
- Always adhere to this format for the tool use to ensure proper parsing and execution.

String and scalar parameters should be specified as is, while lists and objects should use JSON format. Note that spaces for string values are not stripped. The output is not expected to be valid XML and is parsed with regular expressions.
Here are the functions available in JSONSchema format:
{mcp_server_definitions}
# General Objective

You accomplish a given task iteratively, breaking it down into clear steps and working through them methodically.

# Agent Specific Objective

You are a task-solving agent that uses tools step-by-step to answer the user's question. Your goal is to provide complete, accurate and well-reasoned answers using additional tools."""


def render_server_definitions(servers: Iterable[Mapping[str, Any]]) -> str:
    """``servers``: ``[{"name": ..., "tools": [{"name", "description", "schema"}, ...]}, ...]``."""
    out = ""
    for server in servers:
        out += f"\n## Server name: {server['name']}\n"
        for tool in server.get("tools", ()):
            schema = (
                tool["schema"]
                if isinstance(tool["schema"], str)
                else json.dumps(tool["schema"], ensure_ascii=False)
            )
            out += f"### Tool name: {tool['name']}\n"
            out += f"Description: {tool['description']}\n"
            out += f"Input JSON schema: {schema}\n"
    return out


def system_prompt(servers: Iterable[Mapping[str, Any]], date: dt.date | str | None = None) -> str:
    if date is None:
        date = dt.date.today()
    formatted = date if isinstance(date, str) else date.strftime("%Y-%m-%d")
    return SYSTEM_PROMPT_TEMPLATE.format(
        formatted_date=formatted, mcp_server_definitions=render_server_definitions(servers)
    )


def user_prompt(question: str) -> str:
    """The first user message: the question and the answer-format instruction."""
    return f"{question.strip()}\n\n{ANSWER_INSTRUCTION}"
