"""Shared state: what every gateway replica must agree on or read from the engines. Running
counts (counts: in process or through Redis), admission against per-pod limits (admission) and
the engines' own scraped load (engine_metrics, over tokenizer.http1's kept-alive connections).

It imports routing's core modules (pods, registry, errors, metrics, background), not scheduling.
"""
