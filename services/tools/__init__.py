"""Tool gateway: MCP-style web search and page reading (Serper, Jina, summariser) and the offline corpus."""
