"""Routing: pods and their discovery, scorers and named strategies, and the
running-request counts shared through Redis.

It may import kvcache/ (the prefix index) and tokenizer/ types, never plugin/;
plugin/ wires a Router together and calls it per request.

Its rooms: the core at the top (pods: Pod; registry: PodRegistry; router: Router; errors; metrics;
background), and four sub-packages by concern: discovery/ (where pods come from: static, k8s, kube,
inferencepool), state/ (what replicas share or read from engines: counts, admission, engine_metrics),
learning/ (what past requests teach: tracking, predictor, profiles) and scheduling/ (the
filter/scorer/picker framework and the named strategies: scoring, scorers, approx, slo, strategies).
"""
from routing.errors import (DiscoveryError, NoReadyPodError, RoutingError, UnknownModelError,
                            UnknownStrategyError)
from routing.pods import KVEventsEndpoint, Pod
from routing.registry import PodRegistry
from routing.scheduling.scoring import Decision, RouteRequest

__all__ = ["DiscoveryError", "NoReadyPodError", "RoutingError", "UnknownModelError", "UnknownStrategyError",
           "KVEventsEndpoint", "Pod", "PodRegistry", "Decision", "RouteRequest"]
