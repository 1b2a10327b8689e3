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


class NoEligibleEndpointError(RoutingError):
    """The data plane's subset hint leaves no pod that serves the model and is ready (HTTP 503)."""

    def __init__(self, model: str, subset: frozenset[str]) -> None:
        shown = ", ".join(sorted(subset)[:8]) + (", ..." if len(subset) > 8 else "")
        super().__init__(f"no ready pod of model {model!r} among the endpoints the gateway allowed ({shown or 'none'})")
        self.model = model
        self.subset = subset


class SaturatedError(RoutingError):
    """A sheddable request while every eligible pod is saturated (HTTP 429)."""

    def __init__(self, model: str, pods: int) -> None:
        super().__init__(f"all {pods} eligible pods of model {model!r} are saturated; sheddable request dropped")
        self.model = model
