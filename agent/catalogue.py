"""The tool catalogue: which MCP servers and tools the agent has, with their input schemas.

The same catalogue is served by the gateway (``GET /tools``), rendered into the
system prompt's ``{mcp_server_definitions}``, and used to validate calls. Names follow
MiroThinker's servers: ``google_search`` on ``search_and_scrape_webpage`` and
``scrape_and_extract_info`` on ``jina_scrape_llm_summary``. Every backend (Serper +
Jina, or the offline corpus) implements these two tools with the same result format.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["READ", "SEARCH", "TOOLS", "GoogleSearchArgs", "ScrapeArgs", "ToolSpec", "catalogue", "find_tool"]


class GoogleSearchArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    q: str = Field(min_length=1, max_length=2048, description="Search query string")
    gl: str = Field(
        default="us", min_length=2, max_length=8, description="Country context for results, e.g. 'us'"
    )
    hl: str = Field(default="en", min_length=2, max_length=8, description="Language of results, e.g. 'en'")
    location: str | None = Field(
        default=None, max_length=256, description="Location to search from, e.g. 'Paris, France'"
    )
    num: int = Field(default=10, ge=1, le=100, description="Number of results to return")
    tbs: str | None = Field(
        default=None, pattern=r"^qdr:[hdwmy]$", description="Time filter: qdr:h, qdr:d, qdr:w, qdr:m or qdr:y"
    )
    page: int = Field(default=1, ge=1, le=100, description="Result page, starting at 1")
    autocorrect: bool = Field(default=True, description="Whether to autocorrect the query spelling")


class ScrapeArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(min_length=1, max_length=4096, description="The URL of the page to read")
    info_to_extract: str = Field(
        min_length=1, max_length=4096, description="What to look for on the page (usually a question)"
    )


class ToolSpec(BaseModel):
    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    server_name: str
    name: str
    description: str
    args_model: type[BaseModel]

    def input_schema(self) -> dict[str, Any]:
        """The arguments' JSON Schema as the agent reads it: type, description and default of each
        field (validation still applies every constraint of ``args_model``)."""
        schema = self.args_model.model_json_schema()
        props = {}
        for key, prop in schema["properties"].items():
            if "anyOf" in prop:  # Optional[X]: show the plain type
                prop = {**next(t for t in prop["anyOf"] if t.get("type") != "null"), **prop}
            shown = {"type": prop["type"], "description": prop["description"]}
            if prop.get("default") is not None:
                shown["default"] = prop["default"]
            props[key] = shown
        return {"type": "object", "properties": props, "required": schema.get("required", [])}


SEARCH = ToolSpec(
    server_name="search_and_scrape_webpage",
    name="google_search",
    description=(
        "Search the web and return the top results (title, link and snippet of each), plus an answer box "
        "or knowledge graph when there is one."
    ),
    args_model=GoogleSearchArgs,
)
READ = ToolSpec(
    server_name="jina_scrape_llm_summary",
    name="scrape_and_extract_info",
    description=(
        "Read the page at a URL and extract the information you ask for: returns the evidence found on the page "
        "and a summary for your goal."
    ),
    args_model=ScrapeArgs,
)
TOOLS: tuple[ToolSpec, ...] = (SEARCH, READ)


def catalogue(tools: tuple[ToolSpec, ...] = TOOLS) -> list[dict[str, Any]]:
    """``[{"name": server, "tools": [{"name", "description", "schema"}]}]``, servers in first-seen order."""
    servers: dict[str, list[dict[str, Any]]] = {}
    for t in tools:
        servers.setdefault(t.server_name, []).append(
            {"name": t.name, "description": t.description, "schema": t.input_schema()}
        )
    return [{"name": s, "tools": ts} for s, ts in servers.items()]


def find_tool(server_name: str, tool_name: str, tools: tuple[ToolSpec, ...] = TOOLS) -> ToolSpec | None:
    for t in tools:
        if t.server_name == server_name and t.name == tool_name:
            return t
    return None
