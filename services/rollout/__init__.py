"""Rollout workers: the multi-turn search agent (SGLang or in-process engine), verifier rewards,
trajectory groups onto the bus."""
