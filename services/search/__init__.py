"""The offline search engine over a local corpus (BM25 search, extractive reading) and the result
shapes every tool backend returns. Shared by the tool gateway, which serves it, and the world
generator's oracle, which drives it directly to write SFT trajectories: neither is a service."""
