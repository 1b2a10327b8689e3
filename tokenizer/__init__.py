"""Tokenization as the engine does it: remote (the engine's own /tokenize) or
local (a transformers tokenizer), behind one interface and a prefix-aware cache.

It imports nothing from kvgate's other packages; plugin/ builds the inputs from
request bodies and routing/ consumes the token ids.
"""
