"""The agent's text protocol, shared by the rollout loop and the oracle that writes SFT data:
the paper's Appendix A system prompt, the ``<use_mcp_tool>`` call format and how tool
results are returned."""
