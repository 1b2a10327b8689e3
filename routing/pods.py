"""Pods: the vLLM replicas kvgate may route to."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVEventsEndpoint:
    """Where one pod publishes KV events; rank r of a data-parallel pod uses port + r."""

    pub_port: int = 5557
    replay_port: int | None = 5558
    dp_size: int = 1


@dataclass(frozen=True, slots=True)
class Pod:
    name: str
    address: str  # IP (v4 or v6) or host name
    port: int
    model: str  # base model served
    lora: tuple[str, ...] = ()  # adapter names this pod serves
    kv_events: KVEventsEndpoint | None = None
    ready: bool = True

    @property
    def endpoint(self) -> str:
        """`ip:port` as Envoy's ORIGINAL_DST cluster expects it ([v6]:port for IPv6)."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.endpoint}"

    def serves(self, model: str) -> bool:
        return model == self.model or model in self.lora
