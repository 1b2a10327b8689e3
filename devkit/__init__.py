"""Development tools, kept out of the serving packages: the loopback stack of real processes
(stack), the demo (`kvgate demo`), the demo's chat workload (workload), a stand-in /tokenize
server (tokenizer_stub) and the builder of the project's test tokenizer (build_testdata).

It may import every kvgate package; no serving package imports it.
"""
