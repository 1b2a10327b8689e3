"""Routing: pods and their discovery, scorers and named strategies, and the
running-request counts shared through Redis.

It may import kvcache/ (the prefix index) and tokenizer/ types, never plugin/;
plugin/ wires a Router together and calls it per request.

Modules: pods (Pod), registry (PodRegistry), discovery (static source), k8s (Kubernetes
source), counts (running counts, local or Redis), scoring (the filter/scorer/picker
framework, RouteRequest, Decision), scorers, strategies (the named configurations),
engine_metrics (/metrics scraping), router (Router), errors, metrics.
"""
from routing.errors import (DiscoveryError, NoReadyPodError, RoutingError, UnknownModelError,
                            UnknownStrategyError)
from routing.pods import KVEventsEndpoint, Pod
from routing.registry import PodRegistry
from routing.scheduling.scoring import Decision, RouteRequest

__all__ = ["DiscoveryError", "NoReadyPodError", "RoutingError", "UnknownModelError", "UnknownStrategyError",
           "KVEventsEndpoint", "Pod", "PodRegistry", "Decision", "RouteRequest"]
