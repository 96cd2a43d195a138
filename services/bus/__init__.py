"""Typed Redis Streams for the pipeline: publish, consume with consumer groups, dead letters.

Delivery is at-least-once with idempotent consumers:

* ``publish`` XADDs the binary message with approximate MAXLEN trimming;
* ``consume`` reads with XREADGROUP (blocking), runs the handler, and only then
  marks the message id done and XACKs, atomically;
* a live consumer keeps what it holds fresh with a heartbeat (``heartbeat_ms``) so it
  is not stolen mid-handler; entries a dead consumer left pending for
  ``MISSED_BEATS`` heartbeats (``claim_idle_ms``) are taken over with XAUTOCLAIM by
  any consumer of the group, whatever its name, and a restarted consumer of the same
  name takes back its own at once; both are logged;
* payloads that fail validation, and entries delivered more than ``max_deliveries``
  times, go to the dead-letter stream with the cause; so does, at once, an entry whose
  handler made a message past ``max_message_bytes`` (Redis would drop the connection);
* a redelivered message whose id was already processed is acknowledged without
  running the handler again;
* acknowledged history is trimmed (XTRIM MINID below the oldest entry any group
  still needs), so Redis memory follows what is in flight, not what has passed;
* a work stream's message past ``claim_bytes`` (4 MiB) is stored beside the stream and
  its entry names it (``services.bus.claims``): consumers read it a few MiB at a time,
  and trimming removes it with its entry;
* a large value is written from its parts, never joined whole, and what the bus wrote or read
  is freed a few MiB at a time, the event loop running between (``services.bus.freeing``).
"""

from services.bus.client import Bus
from services.bus.connection import REDIS_DOWN, entry_order, redis_client
from services.bus.delivery import MAX_MESSAGE_BYTES, ConsumerOptions, Delivery, Held, MessageTooLarge

__all__ = [
    "MAX_MESSAGE_BYTES",
    "REDIS_DOWN",
    "Bus",
    "ConsumerOptions",
    "Delivery",
    "Held",
    "MessageTooLarge",
    "entry_order",
    "redis_client",
]
