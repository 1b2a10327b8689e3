"""The ext_proc server, the `kvgate` command line and the configuration: the
layer that wires kvcache/, tokenizer/ and routing/ together behind Envoy.

It may import every other kvgate package; nothing imports it.
"""
