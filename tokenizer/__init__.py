"""Tokenization as the engine does it: remote (the engine's own /tokenize) or
local (a transformers tokenizer), behind one interface and a prefix-aware cache.

It imports nothing from kvgate's other packages; plugin/ builds the inputs from
request bodies and routing/ consumes the token ids.

Modules: types (inputs, the Tokenizer protocol, TokenizerError), remote
(RemoteTokenizer), transport (its httpx transport: one write per request, proxies
from the environment), http1 (the small HTTP/1.1 client it uses where no proxy, TLS or
credentials apply; routing's engine scrapes use it too), local (LocalTokenizer, LocalBackend), segments (exact cutting
at added tokens), wordcache (the word-cached encoder and its C scanner), cache
(CachedTokenizer), hub (files by model name), vllm_chat (vLLM's chat rendering) and
testdata (the project's small test tokenizer, built by devkit.build_testdata).
"""
