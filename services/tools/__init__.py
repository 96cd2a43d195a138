"""Tool gateway: MCP-style web search and page reading (Serper, Jina, summariser), or the offline
search engine of :mod:`services.search`, served over HTTP with caching, budgets and limits."""
