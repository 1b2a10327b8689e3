"""Errors the routing layer raises; plugin/ maps each to an HTTP status."""
from __future__ import annotations


class RoutingError(Exception):
    """A request cannot be routed."""


class UnknownModelError(RoutingError):
    """No pod, ready or not, serves the requested model (HTTP 404, code `model_not_found`)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"model {model!r} is not served by any known pod")
        self.model = model


class NoReadyPodError(RoutingError):
    """Pods serve the model but none is ready now (HTTP 503)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"no ready pod serves model {model!r}; try again shortly")
        self.model = model


class UnknownStrategyError(RoutingError):
    """The `routing-strategy` header names no configured strategy (HTTP 400)."""

    def __init__(self, name: str, known: tuple[str, ...]) -> None:
        super().__init__(f"unknown routing strategy {name!r}; known: {', '.join(known)}")
        self.name = name
        self.known = known


class DiscoveryError(ValueError):
    """A pod source (file, list, Kubernetes object) holds content that cannot be used; names the source."""
