"""KV cache events and the prefix index: vLLM's KV event wire protocol, the ingest thread that keeps
each engine's stream complete, and the index of which pod holds which prefix block.

Modules in the order an event goes through them:
- events.py, wire.py, zmtp.py: the wire (the event types, vLLM's msgpack batches, the ZMTP SUB peer
  the live batches are read with); publisher.py is vLLM's side, for tests and benchmarks;
- stream.py: one engine endpoint's stream (Subscriber): sequence order, duplicates, replay, gaps;
- ingest.py: the ingest thread (SubscriberManager, IngestLoop) that reads every endpoint and feeds
  each stream, off the event loop;
- sink.py: EventSink, the whole contract between the ingest path and the index it feeds;
- index.py (with blockkeys.py): PrefixIndex, the index itself;
- locking.py: the index lock, the request path's locked view of the index (LockedIndex) and the GIL
  tuning while batches are applied.
metrics.py holds the ingest path's Prometheus metrics.

This package imports nothing from kvgate's other packages (only the standard
library, msgpack, numpy, pyzmq and prometheus-client); routing/ and plugin/ build on it.
Its hot loops (block keys, raw batch ingest, match) are C: kvcache/csrc/, one file per part,
built at install as the module kvcache._native.
"""
