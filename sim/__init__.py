"""A simulated vLLM engine: vLLM's OpenAI HTTP API, /tokenize, /metrics and KV
events byte for byte, over a paged prefix cache model with no GPU.

It may import kvcache/ (event encoding and publishing) and tokenizer/ (the test
tokenizer files), never routing/ or plugin/.
"""
