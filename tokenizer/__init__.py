"""Tokenization as the engine does it: remote (the engine's own /tokenize) or
local (a transformers tokenizer), behind one interface and a prefix-aware cache.

It imports nothing from kvgate's other packages; plugin/ builds the inputs from
request bodies and routing/ consumes the token ids.

Modules: types (inputs, the Tokenizer protocol, TokenizerError), remote
(RemoteTokenizer), local (LocalTokenizer, LocalBackend), segments (exact cutting
at added tokens), cache (CachedTokenizer), throttle (LogThrottle), stub_server (a
loopback /tokenize for tests and benchmarks), build_testdata and testdata (the
project's small test tokenizer).
"""
