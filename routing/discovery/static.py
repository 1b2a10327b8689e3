"""Pod discovery: a static source (YAML file and/or one-line list) here, Kubernetes in
routing.discovery.k8s; both have the same two methods, `start(registry)` and `stop()`.

A source's `start(registry)` loads the first list (raising DiscoveryError, which names
the source, if it cannot) and then keeps the registry current in the background; a bad
update is logged and counted and the last good list stays.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import yaml

from routing.errors import DiscoveryError
from routing.metrics import RoutingMetrics
from routing.pods import ROLES, KVEventsEndpoint, Pod
from routing.registry import PodRegistry

log = logging.getLogger(__name__)


# ---- parsing --------------------------------------------------------------------------------

_POD_KEYS = {"name", "address", "port", "model", "kv_events", "lora", "ready", "role", "roleset"}
_KV_KEYS = {"pub_port", "replay_port", "dp_size"}


def _port(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise DiscoveryError(f"{where}: expected a port number 1-65535, got {value!r}")
    return value


def _port_or_none(value: Any, where: str) -> int | None:
    return None if value is None else _port(value, where)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DiscoveryError(f"{where}: expected a non-empty string, got {value!r}")
    return value.strip()


def kv_events_from_mapping(raw: Any, where: str) -> KVEventsEndpoint | None:
    """`kv_events`: absent/false -> None, true -> defaults, or a mapping of the three fields."""
    if raw is None or raw is False:
        return None
    if raw is True:
        return KVEventsEndpoint()
    return kv_events_from_fields(raw, where)


def kv_events_from_fields(raw: Any, where: str) -> KVEventsEndpoint:
    """A `kv_events` mapping of the three fields (each optional: its default if absent)."""
    if not isinstance(raw, dict):
        raise DiscoveryError(f"{where}: expected a mapping or true/false, got {raw!r}")
    unknown = set(raw) - _KV_KEYS
    if unknown:
        raise DiscoveryError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(_KV_KEYS)})")
    dp = raw.get("dp_size", 1)
    if isinstance(dp, bool) or not isinstance(dp, int) or not 1 <= dp <= 1024:
        raise DiscoveryError(f"{where}.dp_size: expected an integer 1-1024, got {dp!r}")
    return KVEventsEndpoint(
        pub_port=_port(raw.get("pub_port", 5557), f"{where}.pub_port"),
        replay_port=_port_or_none(raw.get("replay_port", 5558), f"{where}.replay_port"),
        dp_size=dp,
    )


def pod_from_mapping(raw: Any, where: str) -> Pod:
    if not isinstance(raw, dict):
        raise DiscoveryError(f"{where}: expected a mapping with name, address, port, model; got {raw!r}")
    unknown = set(raw) - _POD_KEYS
    if unknown:
        raise DiscoveryError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(_POD_KEYS)})")
    for key in ("name", "address", "port", "model"):
        if key not in raw:
            raise DiscoveryError(f"{where}: missing {key!r}")
    lora = raw.get("lora") or []
    if isinstance(lora, str):
        lora = [lora]
    if not isinstance(lora, list):
        raise DiscoveryError(f"{where}.lora: expected a list of adapter names, got {lora!r}")
    ready = raw.get("ready", True)
    if not isinstance(ready, bool):
        raise DiscoveryError(f"{where}.ready: expected true or false, got {ready!r}")
    address = _text(raw["address"], f"{where}.address").strip("[]")
    role = raw.get("role", "both")
    if role not in ROLES:
        raise DiscoveryError(f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}")
    roleset = raw.get("roleset", "")
    if not isinstance(roleset, str):
        raise DiscoveryError(f"{where}.roleset: expected a string, got {roleset!r}")
    return Pod(
        name=_text(raw["name"], f"{where}.name"),
        address=address,
        port=_port(raw["port"], f"{where}.port"),
        model=_text(raw["model"], f"{where}.model"),
        lora=tuple(_text(x, f"{where}.lora[{i}]") for i, x in enumerate(lora)),
        kv_events=kv_events_from_mapping(raw.get("kv_events"), f"{where}.kv_events"),
        ready=ready,
        role=role,
        roleset=roleset.strip(),
    )


def _unique(pods: list[Pod], source: str) -> list[Pod]:
    seen: set[str] = set()
    for p in pods:
        if p.name in seen:
            raise DiscoveryError(f"{source}: pod name {p.name!r} appears twice")
        seen.add(p.name)
    return pods


def parse_pods_yaml(text: str, source: str) -> list[Pod]:
    """A YAML list of pods (or a mapping with key `pods`). `source` names the origin in errors."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise DiscoveryError(f"{source}: not valid YAML: {e}") from None
    if isinstance(doc, dict) and set(doc) == {"pods"}:
        doc = doc["pods"]
    if doc is None:
        doc = []
    if not isinstance(doc, list):
        raise DiscoveryError(f"{source}: expected a YAML list of pods, got {type(doc).__name__}")
    return _unique([pod_from_mapping(item, f"{source}: pod #{i}") for i, item in enumerate(doc)], source)


def _split_host_port(hp: str, where: str) -> tuple[str, int]:
    if hp.startswith("["):
        end = hp.find("]")
        if end < 0 or not hp[end + 1:].startswith(":"):
            raise DiscoveryError(f"{where}: expected [ipv6]:port, got {hp!r}")
        host, port_s = hp[1:end], hp[end + 2:]
    else:
        host, sep, port_s = hp.rpartition(":")
        if not sep or ":" in host:
            raise DiscoveryError(f"{where}: expected host:port (IPv6 as [addr]:port), got {hp!r}")
    if not host:
        raise DiscoveryError(f"{where}: empty host in {hp!r}")
    if not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
        raise DiscoveryError(f"{where}: bad port {port_s!r}")
    return host, int(port_s)


def _oneliner_options(query: str, where: str) -> tuple[KVEventsEndpoint | None, tuple[str, ...], str]:
    kv: dict[str, Any] = {}
    lora: tuple[str, ...] = ()
    role = "both"
    for part in filter(None, query.split("&")):
        key, _, value = part.partition("=")
        try:
            if key == "kv":
                kv["pub_port"] = int(value) if value else 5557
            elif key == "replay":
                kv["replay_port"] = None if value == "none" else int(value)
            elif key == "dp":
                kv["dp_size"] = int(value)
            elif key == "lora":
                lora = tuple(x for x in value.split("+") if x)
            elif key == "role":
                if value not in ROLES:
                    raise DiscoveryError(f"{where}: role={value!r}: expected one of {', '.join(ROLES)}")
                role = value
            else:
                raise DiscoveryError(f"{where}: unknown option {key!r} (known: kv, replay, dp, lora, role)")
        except ValueError:
            raise DiscoveryError(f"{where}: option {key}={value!r} is not a number") from None
    return (kv_events_from_mapping(kv, where) if kv else None), lora, role


def parse_pods_line(line: str, source: str = "KVGATE_PODS") -> list[Pod]:
    """`name=host:port/model[?kv[=pub]&replay=port|none&dp=N&lora=a+b&role=prefill|decode|both],...`; IPv6 as
    `[::1]:8000`."""
    pods = []
    for i, item in enumerate(x.strip() for x in line.split(",")):
        if not item:
            continue
        where = f"{source}: item #{i} {item!r}"
        name, eq, rest = item.partition("=")
        if not eq or not name.strip():
            raise DiscoveryError(f"{where}: expected name=host:port/model")
        start = rest.find("]") + 1 if rest.startswith("[") else 0
        slash = rest.find("/", start)
        if slash < 0:
            raise DiscoveryError(f"{where}: expected name=host:port/model (model missing)")
        host, port = _split_host_port(rest[:slash], where)
        model, _, query = rest[slash + 1:].partition("?")
        if not model:
            raise DiscoveryError(f"{where}: empty model")
        kv, lora, role = _oneliner_options(query, where)
        pods.append(Pod(name=name.strip(), address=host, port=port, model=model, lora=lora, kv_events=kv, role=role))
    return _unique(pods, source)


# ---- the static source ---------------------------------------------------------------------

class StaticSource:
    """Pods from `KVGATE_PODS_FILE` (re-read when its mtime, size or inode changes) and/or `KVGATE_PODS`."""

    def __init__(self, pods_file: str = "", pods_line: str = "", *, poll_interval_s: float = 1.0,
                 metrics: RoutingMetrics | None = None) -> None:
        if not pods_file and not pods_line:
            raise DiscoveryError("KVGATE_PODS_FILE or KVGATE_PODS: one is required for static discovery")
        self._file = pods_file
        self._line_pods = parse_pods_line(pods_line) if pods_line else []
        self._poll = poll_interval_s
        self._metrics = metrics or RoutingMetrics()
        self._stamp: tuple[int, int, int] | None = None
        self._task: asyncio.Task | None = None
        self._registry: PodRegistry | None = None
        self.reload_errors = 0
        self.last_error: str | None = None

    def _source(self) -> str:
        return f"KVGATE_PODS_FILE {self._file}"

    def _read(self) -> list[Pod]:
        try:
            st = os.stat(self._file)
            with open(self._file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise DiscoveryError(f"{self._source()}: cannot read: {e.strerror or e}") from None
        self._stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        pods = parse_pods_yaml(text, self._source())
        return _unique(pods + self._line_pods, f"{self._source()} + KVGATE_PODS")

    def load(self) -> list[Pod]:
        """The full list now; raises DiscoveryError naming the source."""
        return self._read() if self._file else list(self._line_pods)

    async def start(self, registry: PodRegistry) -> None:
        self._registry = registry
        registry.replace(self.load())
        self._metrics.discovery_pods.set(len(registry.pods()))
        if self._file:
            self._task = asyncio.create_task(self._watch(), name="kvgate-static-pods")

    def check_now(self) -> bool:
        """Reload if the file changed; True if a new list was applied."""
        assert self._registry is not None, "start() first"
        try:
            st = os.stat(self._file)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = None
        if stamp is not None and stamp == self._stamp:
            return False
        try:
            pods = self._read()
        except DiscoveryError as e:
            if str(e) != self.last_error:  # log a persistent error once, count every attempt
                log.error("pod list not reloaded, keeping the last good one: %s", e)
            self.last_error = str(e)
            self.reload_errors += 1
            self._metrics.discovery_errors.labels("static").inc()
            return False
        self.last_error = None
        self._registry.replace(pods)
        self._metrics.discovery_pods.set(len(pods))
        return True

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._poll)
            try:
                self.check_now()
            except Exception:
                log.exception("static pod discovery: unexpected error")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
