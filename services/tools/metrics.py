"""Prometheus metrics of the tool gateway (scraped at ``/metrics``)."""

import functools

from prometheus_client import Counter, Gauge, Histogram

CALLS = Counter("pbsd_tools_calls_total", "Tool calls answered", ["tool", "backend", "outcome"])
CALL_SECONDS = Histogram(
    "pbsd_tools_call_seconds",
    "Tool call latency, cache hits included",
    ["tool", "backend"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
CACHE = Counter("pbsd_tools_cache_total", "Cache lookups by result (hit or miss)", ["tool", "result"])
STORE_FALLBACKS = Counter(
    "pbsd_tools_store_fallbacks_total",
    "Cache and budget operations served in process because Redis was unreachable or refused writes",
    ["op"],
)
CACHE_WRITES_SKIPPED = Counter(
    "pbsd_tools_cache_writes_skipped_total",
    "Cache entries not written to Redis because it held PBSD_TOOLS_CACHE_REDIS_SHARE of its maxmemory",
)
MERGED = Counter("pbsd_tools_merged_total", "Calls answered by an identical call already in flight", ["tool"])
UPSTREAM_REQUESTS = Counter(
    "pbsd_tools_upstream_requests_total", "Upstream answers by status", ["upstream", "status"]
)
UPSTREAM_RETRIES = Counter(
    "pbsd_tools_upstream_retries_total", "Upstream retries by reason", ["upstream", "reason"]
)
BREAKER_STATE = Gauge(
    "pbsd_tools_breaker_state", "Circuit breaker state: 0 closed, 1 half-open, 2 open", ["upstream"]
)
SSRF_BLOCKED = Counter("pbsd_tools_ssrf_blocked_total", "Page reads refused by the SSRF guard")
ENCODING_REFUSED = Counter(
    "pbsd_tools_encoding_refused_total",
    "Page reads refused for a content encoding the reader does not decode",
)
SERPER_CREDITS = Counter("pbsd_tools_serper_credits_total", "Credits Serper's replies say the searches cost")
BUDGET_EXHAUSTED = Counter("pbsd_tools_budget_exhausted_total", "Calls refused by a trajectory's call budget")


@functools.cache
def child(metric, *labels: str):
    """``metric.labels(*labels)``, looked up once: every call counts on the hot path, and the
    label values (tools, backends, outcomes) are a handful."""
    return metric.labels(*labels)
