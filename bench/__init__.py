"""Benchmarks behind `kvgate bench ...`: each prints a table, and one JSON object
with --json.

Benchmarks may import every kvgate package; nothing imports them.
"""
