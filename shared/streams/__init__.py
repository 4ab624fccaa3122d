"""A Redis Streams transport that loses nothing (Redis 7.0 commands only).

Guarantees, each tested in ``tests/integration/test_streams.py``:

* **Consumer groups, acks.** Replicas share a stream through one consumer group. An entry stays pending
  until :meth:`StreamConsumer.commit` acknowledges it, in the same ``MULTI/EXEC`` that writes its results
  downstream (both live on the same Redis), so a crash leaves either nothing or everything done.
* **Recovery.** A consumer first re-reads its own pending entries (a restart under a stable name). Entries
  idle longer than ``claim_idle_ms`` - their consumer died - are taken over with ``XAUTOCLAIM``. A live
  consumer keeps its in-flight entries fresh (``XCLAIM ... JUSTID``), so slow work is not stolen, and one that
  gives an entry up while alive can hand it back (``release(at_once=True)``: its idle time set past the bound,
  still pending), so the next claim takes it without waiting ``claim_idle_ms``. A read
  that fails may have been carried out (a reply lost as Redis or the link went down); after it, and every
  few seconds, a read takes back what is pending under the consumer's name and not held by it
  (:meth:`StreamConsumer.recover_lost`).
* **Poison entries.** An entry delivered more than ``max_deliveries`` times, or one the service rejects,
  moves to the dead-letter stream with its reason and original payload. A malformed entry (its fields are
  not exactly a UTF-8 record id and a payload: anyone who can write to Redis can add arbitrary bytes) moves
  there on first sight, its fields kept exactly; reading never raises on an entry's bytes.
* **Exactly-once effect.** Each entry carries a record id. Committing sets an "applied" key under ``WATCH``;
  an entry whose record was already applied (a redelivery, or a producer that retried its ``XADD``) is acked
  without being applied again.
* **Backpressure.** A producer waits while the stream's backlog (undelivered plus pending entries of its
  busiest consumer group) is at its bound; streams are trimmed only below the oldest entry that some group
  still needs (``XTRIM MINID``), so trimming never drops unprocessed work.

The Redis client is passed in (``redis.asyncio.Redis`` created with ``decode_responses=False``); nothing
here holds a module-level connection.

Modules, by concern: :mod:`.entries` (the entry layout and what a consumer is handed), :mod:`.groups`
(consumer groups: creation, backlog, trimming), :mod:`.producer` (adding under the backlog bound),
:mod:`.consumer` (reading, claiming, committing), :mod:`.reader` (where a consumer's next entries come from),
:mod:`.dead_letter` (setting poison entries aside) and :mod:`.outcomes` (a reader's reject-or-release of a
delivery it will not commit).
"""

from shared.streams.consumer import StreamConsumer, StreamStats
from shared.streams.entries import Delivery, default_consumer_name
from shared.streams.groups import ensure_group, group_backlog, stream_backlog, trim_processed
from shared.streams.producer import Output, StreamProducer

__all__ = [
    "Delivery",
    "Output",
    "StreamConsumer",
    "StreamProducer",
    "StreamStats",
    "default_consumer_name",
    "ensure_group",
    "group_backlog",
    "stream_backlog",
    "trim_processed",
]
