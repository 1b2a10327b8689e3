"""Pods: the vLLM replicas kvgate may route to."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class KVEventsEndpoint:
    """Where one pod publishes KV events; rank r of a data-parallel pod uses port + r."""

    pub_port: int = 5557
    replay_port: int | None = 5558
    dp_size: int = 1


ROLES = ("both", "prefill", "decode")  # a pod's part in prefill/decode disaggregation (routing.pd)


@dataclass(frozen=True, slots=True)
class Pod:
    name: str
    address: str  # IP (v4 or v6) or host name
    port: int
    model: str  # base model served
    lora: tuple[str, ...] = ()  # adapter names this pod serves
    kv_events: KVEventsEndpoint | None = None
    ready: bool = True
    # Prefill/decode disaggregation: "prefill", "decode" or "both" (serves whole requests, the default), and the
    # group (AIBrix's roleset) whose prefill and decode engines exchange KV blocks ("": any engine of the model).
    role: str = "both"
    roleset: str = ""
    # Set on a routing target for one data-parallel rank of pod `parent` (see rank_targets()):
    # the router scores and counts each rank of a DP pod as a target of its own.
    rank: int | None = None
    parent: str = ""
    # `ip:port` as Envoy's ORIGINAL_DST cluster expects it ([v6]:port for IPv6): derived from address
    # and port once, at construction (every routed request reads it several times).
    endpoint: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"pod {self.name}: role must be one of {', '.join(ROLES)}, got {self.role!r}")
        host = f"[{self.address}]" if ":" in self.address else self.address
        object.__setattr__(self, "endpoint", f"{host}:{self.port}")

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks behind the pod's one HTTP port (known from its KV events endpoint)."""
        return 1 if self.kv_events is None else self.kv_events.dp_size

    @property
    def pod_name(self) -> str:
        """The discovered pod's name: `name`, or a rank target's pod."""
        return self.parent or self.name

    def rank_targets(self) -> tuple[Pod, ...]:
        """One target per data-parallel rank, named `<name>#<rank>`, at the pod's endpoint: the
        engine serves a request on the rank its `x-data-parallel-rank` header names."""
        return tuple(dataclasses.replace(self, name=f"{self.name}#{r}", rank=r, parent=self.name)
                     for r in range(self.dp_size))

    @property
    def base_url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def prefills(self) -> bool:
        """May run a disaggregated request's prefill leg."""
        return self.role != "decode"

    @property
    def decodes(self) -> bool:
        """May run a disaggregated request's decode leg, or a whole request."""
        return self.role != "prefill"

    def serves(self, model: str) -> bool:
        return model == self.model or model in self.lora
