"""The demo's progress lines: timestamped, and written above any progress bar rather than through it."""

from __future__ import annotations

import time

from tqdm import tqdm

__all__ = ["say"]


def say(message: str) -> None:
    tqdm.write(f"[demo {time.strftime('%H:%M:%S')}] {message}")
