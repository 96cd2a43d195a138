"""Prometheus metrics of the bus, shared by every service that publishes or consumes."""

import contextlib

from prometheus_client import Counter, Histogram

PUBLISHED = Counter("pbsd_bus_published_total", "Messages published", ["stream"])
PUBLISHED_BYTES = Counter("pbsd_bus_published_bytes_total", "Payload bytes published", ["stream"])
CLAIMED = Counter(
    "pbsd_bus_claimed_total",
    "Messages published by reference: stored beside their work stream, the entry naming them",
    ["stream"],
)
TOO_LARGE = Counter(
    "pbsd_bus_too_large_total", "Messages refused before publishing: past the bus's size limit", ["stream"]
)
CONSUMED = Counter("pbsd_bus_processed_total", "Messages handled and acknowledged", ["stream", "group"])
DUPLICATES = Counter(
    "pbsd_bus_duplicates_total",
    "Redeliveries of already-processed messages, acknowledged unprocessed",
    ["stream", "group"],
)
RECLAIMED = Counter(
    "pbsd_bus_reclaimed_total", "Entries claimed from a consumer that stopped answering", ["stream", "group"]
)
TAKEN_OVER = Counter(
    "pbsd_bus_taken_over_total",
    "Handlers stopped because another consumer took their entry over (this one missed its heartbeats)",
    ["stream", "group"],
)
HANDLER_ERRORS = Counter(
    "pbsd_bus_handler_errors_total",
    "Handler failures (the entry stays pending for a retry)",
    ["stream", "group"],
)
DEAD_LETTERED = Counter(
    "pbsd_bus_dead_lettered_total", "Entries moved to the dead-letter stream", ["stream", "group", "reason"]
)
HANDLER_SECONDS = Histogram(
    "pbsd_bus_handler_seconds",
    "Time spent in a message handler",
    ["stream", "group"],
    buckets=(0.005, 0.02, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
OUTAGES = Counter(
    "pbsd_bus_outage_waits_total",
    "Waits of a consumer for Redis to come back (or its group to be remade)",
    ["stream"],
)

DEAD_LETTER_REASONS = ("invalid", "max_deliveries", "trimmed", "too_large", "lost")


def consumer_series(stream: str, group: str) -> None:
    """A consumer group's counters, at zero from its first read: a panel of errors or dead letters
    shows 0 instead of "no data", and rate() sees the first one happen (a series that appears at
    1 has no earlier sample to rise from)."""
    for counter in (CONSUMED, DUPLICATES, RECLAIMED, TAKEN_OVER, HANDLER_ERRORS):
        counter.labels(stream, group)
    for reason in DEAD_LETTER_REASONS:
        DEAD_LETTERED.labels(stream, group, reason)


def forget_series(stream: str, group: str) -> None:
    """Drop a destroyed group's series: each run's trainer groups go with the run, and their series
    would otherwise pile up in the trainer's exporter, a dozen a run, for as long as it lives."""
    for metric in (CONSUMED, DUPLICATES, RECLAIMED, TAKEN_OVER, HANDLER_ERRORS, HANDLER_SECONDS):
        with contextlib.suppress(KeyError):
            metric.remove(stream, group)
    for reason in DEAD_LETTER_REASONS:
        with contextlib.suppress(KeyError):
            DEAD_LETTERED.remove(stream, group, reason)
