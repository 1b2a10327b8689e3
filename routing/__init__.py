"""Routing: pods and their discovery, scorers and named strategies, and the
running-request counts shared through Redis.

It may import kvcache/ (the prefix index) and tokenizer/ types, never plugin/;
plugin/ wires a Router together and calls it per request.
"""
