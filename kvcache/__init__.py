"""KV cache events and the prefix index: vLLM's KV event wire protocol, the ZMQ
subscriber that keeps each engine's stream complete, and the index of which pod
holds which prefix block.

This package imports nothing from kvgate's other packages (only the standard
library, msgpack, numpy, pyzmq and prometheus-client); routing/ and plugin/ build on it.
Its hot loops (block keys, raw batch ingest, match) are C: kvcache/native/, one file per part,
built at install as the module kvcache._native.
"""
