"""kvgate's configuration: every KVGATE_* environment variable, read once at start-up.

`VARIABLES` is the single list of variables: `Settings.from_env` reads exactly
these, and the README's table is generated from it (`python -m plugin.config`),
so a variable cannot be documented and read nowhere, or read and undocumented.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

from routing.state.counts import redact_url
from routing.scheduling.strategies import SCORERS, STRATEGIES, markdown_tables, parse_mix, parse_weights


class ConfigError(ValueError):
    """A KVGATE_* variable holds a value kvgate cannot use; the message names it."""


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _int_range(lo: int, hi: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw.strip())
        if not lo <= value <= hi:
            raise ValueError(f"expected an integer from {lo} to {hi}")
        return value

    return parse


def _positive_float(raw: str) -> float:
    value = float(raw.strip())
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError("expected a positive number")
    return value


def _float_min(lo: float) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        value = float(raw.strip())
        if not value >= lo or value == float("inf"):
            raise ValueError(f"expected a number of at least {lo:g}")
        return value

    return parse


def _float_range(lo: float, hi: float) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        value = float(raw.strip())
        if not lo <= value <= hi:
            raise ValueError(f"expected a number from {lo:g} to {hi:g}")
        return value

    return parse


def _fraction(raw: str) -> float:
    value = float(raw.strip())
    if not 0.0 <= value <= 1.0:
        raise ValueError("expected a number from 0 to 1")
    return value


def _pd_strategies(raw: str) -> str:
    names = [n.strip() for n in raw.split(",") if n.strip()]
    for n in names:
        if n not in STRATEGIES or n == "pd-decode":
            raise ValueError(f"{n!r} is not a strategy that can choose a prefill engine (known: "
                             f"{', '.join(s for s in STRATEGIES if s != 'pd-decode')})")
    return ",".join(names)


def _choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip()
        if value not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return value

    return parse


def _strategy(raw: str) -> str:
    value = raw.strip()
    if value in STRATEGIES:
        return value
    try:
        mix = parse_mix(value)
    except ValueError as e:
        raise ValueError(f"not a strategy nor a weighted mix: {e}") from None
    if mix is None:
        raise ValueError(f"expected one of {', '.join(STRATEGIES)}, or a weighted mix such as "
                         "`prefix-cache:2,least-request:1`")
    return value


def _text(raw: str) -> str:
    return raw.strip()


def _redis_url(raw: str) -> str:
    value = raw.strip()
    if value and not value.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("expected a redis://, rediss:// or unix:// URL, or empty for in-process counts")
    return value


def _slo_targets(raw: str) -> str:
    from routing.scheduling.slo import parse_targets
    parse_targets(raw, "value")
    return raw.strip()


@dataclass(frozen=True)
class Variable:
    env: str
    field: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    secret: bool = False


PORT = _int_range(0, 65535)

VARIABLES: tuple[Variable, ...] = (
    Variable("KVGATE_LISTEN_HOST", "listen_host", _text, "127.0.0.1",
             "Address the gRPC and HTTP servers bind to (`0.0.0.0` or `::` in a cluster)."),
    Variable("KVGATE_GRPC_PORT", "grpc_port", PORT, 50051, "ext_proc gRPC port (also serves gRPC health)."),
    Variable("KVGATE_HTTP_PORT", "http_port", PORT, 8080, "HTTP port: `/metrics`, `/healthz`, `/debug`, the status page `/`."),
    Variable("KVGATE_GRPC_TLS", "grpc_tls", _choice("off", "self-signed", "files"), "off",
             "TLS on the gRPC port: `off` (plaintext h2c), `self-signed` (a certificate made at start, as the "
             "Inference Extension's picker serves; gateways that dial pickers over TLS, e.g. Envoy AI Gateway, do "
             "not verify it) or `files` (KVGATE_GRPC_TLS_CERT and KVGATE_GRPC_TLS_KEY, read again once they change: "
             "looked at when a peer connects or /metrics is scraped, at most every 5 s, so a renewed certificate "
             "(cert-manager's, in a mounted Secret) serves new connections without a restart; a pair that does not "
             "load leaves the last one serving, logged and counted in kvgate_grpc_tls_reloads_total{result="
             "\"failed\"}). The certificate in use expires at kvgate_grpc_tls_certificate_expiry_timestamp_seconds "
             "(alert KvgateGrpcCertificateExpiring: 7 days before)."),
    Variable("KVGATE_GRPC_TLS_CERT", "grpc_tls_cert", _text, "",
             "PEM certificate (chain) file, with KVGATE_GRPC_TLS=files."),
    Variable("KVGATE_GRPC_TLS_KEY", "grpc_tls_key", _text, "", "PEM private key file, with KVGATE_GRPC_TLS=files."),
    Variable("KVGATE_GRPC_SERVER", "grpc_server", _choice("kvgate", "grpcio"), "kvgate",
             "The gRPC server on the gRPC ports: `kvgate` (kvgate's own HTTP/2, on the event loop that routes: one "
             "thread wake-up per message) or `grpcio` (grpcio's asyncio server, which hands each message across "
             "three threads; docs/BENCHMARKS.md, ## path). Both serve ext_proc and health, plaintext and TLS."),
    Variable("KVGATE_GRPC_KEEPALIVE_S", "grpc_keepalive_s", _positive_float, 30.0,
             "A gRPC connection silent this long gets an HTTP/2 PING; one that leaves it unanswered as long again "
             "is closed and its calls end, their requests released (a gateway whose host was lost sends no FIN; "
             "each of its calls holds a routed request's running count). grpcio's server pings after 2 hours."),
    Variable("KVGATE_GRPC_HEALTH_PORT", "grpc_health_port", PORT, 0,
             "A plaintext gRPC port serving only the health services (`liveness`, `readiness`), 0 for none: "
             "Kubernetes' gRPC probes do not speak TLS, so probe this port when KVGATE_GRPC_TLS is on."),
    Variable("KVGATE_DISCOVERY", "discovery", _choice("static", "kubernetes", "inferencepool"), "static",
             "Pod discovery source: `static` (file or list below), `kubernetes` (pods by label) or "
             "`inferencepool` (one InferencePool's pods, models from each pod's `/v1/models`)."),
    Variable("KVGATE_PODS_FILE", "pods_file", _text, "",
             "YAML list of pods (`name`, `address`, `port`, `model`, optional `kv_events`, `lora`); re-read when it changes."),
    Variable("KVGATE_PODS", "pods", _text, "", "Pods as one line: `name=host:port/model,...`."),
    Variable("KVGATE_K8S_NAMESPACE", "k8s_namespace", _text, "",
             "Namespace to watch (empty: the service account's own namespace)."),
    Variable("KVGATE_K8S_LABEL_SELECTOR", "k8s_label_selector", _text, "model.aibrix.ai/name",
             "Label selector of the vLLM pods to watch."),
    Variable("KVGATE_K8S_API_URL", "k8s_api_url", _text, "",
             "Kubernetes API URL (empty: in-cluster service account)."),
    Variable("KVGATE_INFERENCEPOOL_NAME", "inferencepool_name", _text, "",
             "The InferencePool (inference.networking.k8s.io/v1, in KVGATE_K8S_NAMESPACE) to serve, "
             "with `inferencepool` discovery."),
    Variable("KVGATE_POOL_MODELS_REFRESH_S", "pool_models_refresh_s", _positive_float, 30.0,
             "How often each InferencePool endpoint's `/v1/models` is asked again (LoRA adapters come and go)."),
    Variable("KVGATE_ROUTING_STRATEGY", "routing_strategy", _strategy, "kv-sync",
             "Default strategy, or AIBrix's weighted mix of strategies (`prefix-cache:2,least-request:1`, integer "
             "weights, 1 when left out); a request may choose another (or a mix) with the `routing-strategy` header."),
    Variable("KVGATE_ROUTING_WEIGHTS", "routing_weights", _text, "",
             "Scorer weights laid over the defaults: `kv-sync:ttft=3,load=2,queue=1;prefix-cache:...` "
             f"(scorers: {', '.join(SCORERS)}; 0 removes one). kv-sync's reach slo too, which makes kv-sync's "
             "choice among the pods safely within their targets."),
    Variable("KVGATE_ROUTING_GUARD_SLACK", "routing_guard_slack", _int_range(0, 1_000_000), 16,
             "Load guard: a pod running this many more requests than the mean of the other pods (or four "
             "times that beyond the least loaded one) is set aside (with engine metrics scraped: only while its "
             "engine reports requests waiting)..."),
    Variable("KVGATE_ROUTING_GUARD_RATIO", "routing_guard_ratio", _positive_float, 0.7,
             "...or this fraction of that mean (of the least loaded one's count), whichever is larger."),
    Variable("KVGATE_ROUTING_PREFILL_TOKENS_PER_S", "routing_prefill_tokens_per_s", _positive_float, 10_000.0,
             "An engine's prefill speed (tokens/s) until its observed responses teach kvgate its own (the "
             "prior of kv-sync's and slo's TTFT model, which an estimate drifts back to while not re-observed); "
             "the prompt tokens kv-sync sent a pod uncached count as still waiting until prefilled at it."),
    Variable("KVGATE_PD_THRESHOLD_TOKENS", "pd_threshold_tokens", _int_range(0, 10_000_000), 256,
             "The `pd` strategy's decider: a request is split into a prefill and a decode leg only when the "
             "picked decode engine lacks at least this many of its prompt tokens (0: always split); else that "
             "engine serves it whole."),
    Variable("KVGATE_PD_STRATEGIES", "pd_strategies", _pd_strategies, "",
             "Strategies besides `pd` that split requests into a prefill and a decode leg when the model has "
             "prefill engines (`role: prefill`), their own scores choosing the prefill engine: e.g. `kv-sync,slo`. "
             "Empty: they serve whole requests on the decoding engines."),
    Variable("KVGATE_PD_PREFILL_TIMEOUT_S", "pd_prefill_timeout_s", _positive_float, 30.0,
             "The `pd` strategy's bound on one prefill leg (connect to answer), seconds; past it the leg is "
             "retried once on the next prefill engine, then the decode engine serves the request whole."),
    Variable("KVGATE_SESSION_TTL_S", "session_ttl_s", _positive_float, 1800.0,
             "Session affinity: a session (`x-session-id`, `x-session-token`, `x-aibrix-session-key`) whose pod "
             "kvgate remembers is forgotten this long after its last request (shared through KVGATE_REDIS_URL)..."),
    Variable("KVGATE_SESSION_CAPACITY", "session_capacity", _int_range(1, 100_000_000), 100_000,
             "...and each replica remembers at most this many (least recently used forgotten first)."),
    Variable("KVGATE_PREFIX_CACHE_BLOCK_SIZE", "prefix_cache_block_size", _int_range(1, 4096), 16,
             "Block size of the `prefix-cache` strategy's own guesses (kv-sync learns it from events)."),
    Variable("KVGATE_PREFIX_CACHE_BLOCKS", "prefix_cache_blocks", _int_range(1, 1 << 32), 200_000,
             "Most blocks the `prefix-cache` strategy remembers."),
    Variable("KVGATE_FALLBACK_ENDPOINTS", "fallback_endpoints", _int_range(0, 64), 3,
             "Next-best pods listed after the picked one in `x-gateway-destination-endpoint` (and `envoy.lb`), "
             "for the data plane's retries."),
    Variable("KVGATE_SHEDDABLE_OBJECTIVES", "sheddable_objectives", _text, "",
             "Comma-separated objective names (`x-gateway-inference-objective` header) whose requests get 429 "
             "when every eligible pod is saturated."),
    Variable("KVGATE_SATURATION_QUEUE", "saturation_queue", _positive_float, 5.0,
             "A pod is saturated when its engine reports this many waiting requests or more..."),
    Variable("KVGATE_SATURATION_KV_USAGE", "saturation_kv_usage", _positive_float, 0.8,
             "...or its KV cache usage (0..1) at or above this (a pod without a fresh scrape is not saturated)."),
    Variable("KVGATE_ENGINE_METRICS_INTERVAL_S", "engine_metrics_interval_s", _positive_float, 1.0,
             "How often each pod's `/metrics` is scraped (queue length, KV utilisation, liveness)."),
    Variable("KVGATE_PODS_POLL_S", "pods_poll_s", _positive_float, 1.0, "How often KVGATE_PODS_FILE is checked for changes."),
    Variable("KVGATE_REDIS_URL", "redis_url", _redis_url, "",
             "Redis for running-request counts shared by gateway replicas (`redis://`, `rediss://`, `unix://`; the "
             "options redis-py reads in a URL); empty: in-process counts. The counts and the running prompts go "
             "through kvgate's own lean client where the URL has no option but `db` (TLS and other options: "
             "redis-py; `/debug`'s `counts.client` says which). With ACLs, the user needs the keys and channels under `kvgate:` (channels: "
             "the replicas' running prompts, and word of each counts write, so a replica reads the others' counts "
             "only when they changed; without channel rights counts are still shared, read every 5 ms).",
             secret=True),
    Variable("KVGATE_REDIS_KEY_TTL_S", "redis_key_ttl_s", _positive_float, 5.0,
             "A gateway that stops heartbeating has its counts expire after this long (heartbeat: a fifth of it)."),
    Variable("KVGATE_GATEWAY_ID", "gateway_id", _text, "",
             "This replica's name in Redis (empty: host name and process id)."),
    Variable("KVGATE_TOKENIZER", "tokenizer", _choice("auto", "remote", "local"), "auto",
             "`auto`: tokenize locally where the model's tokenizer files can be had (KVGATE_TOKENIZER_PATH, or the "
             "hub with KVGATE_TOKENIZER_HUB), once verified against the engine's `/tokenize`, else ask the engine; "
             "`remote`: always the engine's `/tokenize`; `local`: KVGATE_TOKENIZER_PATH only, never checked."),
    Variable("KVGATE_TOKENIZER_PATH", "tokenizer_path", _text, "",
             "Directory with the engines' tokenizer files (`tokenizer.json`, `tokenizer_config.json`), for every "
             "model (required with `local`)."),
    Variable("KVGATE_TOKENIZER_HUB", "tokenizer_hub", _bool, False,
             "With `auto` and no KVGATE_TOKENIZER_PATH: fetch each model's tokenizer files once from the Hugging "
             "Face hub, the model name as repository (honours HF_ENDPOINT, HF_TOKEN, HF_HOME, HF_HUB_OFFLINE)."),
    Variable("KVGATE_TOKENIZER_CACHE_DIR", "tokenizer_cache_dir", _text, "",
             "Where hub tokenizer files are kept between starts (empty: the hub cache under HF_HOME)."),
    Variable("KVGATE_TOKENIZER_VERIFY_REQUESTS", "tokenizer_verify_requests", _int_range(1, 1_000_000), 5,
             "Requests of each shape (prompt, chat, chat with tools, ...) whose local tokens must equal the "
             "engine's before the local path serves that shape."),
    Variable("KVGATE_TOKENIZER_SAMPLE_RATE", "tokenizer_sample_rate", _fraction, 0.05,
             "Share of locally tokenized requests checked against the engine in the background; any difference "
             "sends the model back to the engine's `/tokenize`."),
    Variable("KVGATE_TOKENIZER_URL", "tokenizer_url", _text, "",
             "Fixed base URL for remote tokenization (empty: a ready pod of the request's model)."),
    Variable("KVGATE_TOKENIZER_TIMEOUT_S", "tokenizer_timeout_s", _positive_float, 1.0,
             "Budget for one tokenization, retries included; past it the request is routed on load alone."),
    Variable("KVGATE_TOKENIZER_CACHE_MB", "tokenizer_cache_mb", _int_range(0, 1 << 20), 256,
             "Tokenization cache size in MiB (0 disables it)."),
    Variable("KVGATE_MAX_BODY_BYTES", "max_body_bytes", _int_range(1024, 1 << 30), 8 << 20,
             "Largest request body accepted; larger gets 413. Keep below Envoy's buffer limit."),
    Variable("KVGATE_TARGET_POD_HEADER", "target_pod_header", _bool, True,
             "Also set AIBrix's `target-pod` header on routed requests."),
    Variable("KVGATE_INDEX_MAX_ENTRIES", "index_max_entries", _int_range(1, 1 << 40), 4_000_000,
             "Most (block, pod) entries the prefix index holds; least recently used go first (approximately: from "
             "the oldest 1/32)."),
    Variable("KVGATE_KV_EVENTS_BACKOFF_MIN_S", "kv_events_backoff_min_s", _positive_float, 1.0,
             "First reconnect delay of a KV event subscription."),
    Variable("KVGATE_KV_EVENTS_BACKOFF_MAX_S", "kv_events_backoff_max_s", _positive_float, 30.0,
             "Longest reconnect delay (the delay doubles up to it)."),
    Variable("KVGATE_KV_EVENTS_REPLAY_TIMEOUT_S", "kv_events_replay_timeout_s", _positive_float, 0.5,
             "How long to wait for an engine's replay answer before going on without it."),
    Variable("KVGATE_KV_EVENTS_HEARTBEAT_S", "kv_events_heartbeat_s", _float_min(0.0), 5.0,
             "ZMTP ping interval on event connections (0 disables dead-peer detection)."),
    Variable("KVGATE_KV_EVENTS_HEARTBEAT_TIMEOUT_S", "kv_events_heartbeat_timeout_s", _positive_float, 15.0,
             "Silence after which an event connection counts as dead and is re-established."),
    Variable("KVGATE_KV_EVENTS_RCV_HWM", "kv_events_rcv_hwm", _int_range(1, 10_000_000), 10_000,
             "Most batches a replay answer queues (live batches wait in the connection's socket buffer)."),
    Variable("KVGATE_KV_EVENTS_TICK_BUDGET_S", "kv_events_tick_budget_s", _positive_float, 0.002,
             "Time the KV event ingest thread spends on one engine's queued batches before the other engines' turn."),
    Variable("KVGATE_KV_EVENTS_COALESCE_S", "kv_events_coalesce_s", _float_range(0.0, 0.1), 0.025,
             "While KV event batches keep coming, the ingest thread wakes this often and takes every batch queued "
             "meanwhile: the index lags by at most this long; a longer interval costs less CPU per batch."),
    Variable("KVGATE_DRAIN_DELAY_S", "drain_delay_s", _float_min(0.0), 3.0,
             "On SIGTERM: readiness turns NOT_SERVING, and new ext_proc streams are still served this long "
             "(while the data plane's health checks notice)..."),
    Variable("KVGATE_DRAIN_TIMEOUT_S", "drain_timeout_s", _float_min(0.0), 25.0,
             "...then new streams are refused and in-flight ones get this long to finish."),
    Variable("KVGATE_OBSERVE_RESPONSES", "observe_responses", _bool, True,
             "Watch routed responses (Envoy streams their bodies through kvgate once the response headers "
             "are seen): TTFT, TPOT and tokens per model and pod, request traces, output-length history."),
    Variable("KVGATE_OBSERVE_SAMPLE", "observe_sample", _fraction, 0.1,
             "With KVGATE_OBSERVE_RESPONSES: the share of routed responses watched (kept evenly spaced) among "
             "those Envoy sends in two messages. A watched response costs two more ext_proc messages (about "
             "300 us of kvgate CPU); an unwatched one asks Envoy for none (its response headers are skipped "
             "too), is still uncounted when its stream ends and still tells the trackers it is done (without "
             "usage). Requests with the slo strategy or SLO headers are always watched. 1: every response. "
             "Envoy chooses for the requests it sends in one message (envoy/envoy.yaml: those with SLO targets or "
             "the slo strategy, and runtime key `kvgate.watch_percent`, 10, of the rest, on the watched routes, "
             "read from a stream of their own): kvgate watches as many two-message ones as keep this share of all."),
    Variable("KVGATE_WATCH_WAIT_S", "watch_wait_s", _float_range(0.1, 300.0), 5.0,
             "With KVGATE_OBSERVE_RESPONSES, a request on envoy/envoy.yaml's watched routes (one message; its response "
             "read by a watch stream Envoy never waits on, perhaps on another replica, which tells the routing one "
             "what it read through KVGATE_REDIS_URL): how long after the request's end its routing replica waits for "
             "that word before counting the response as cut (kvgate_watch_waits_total{outcome=\"expired\"})."),
    Variable("KVGATE_RESPONSE_IDS", "response_ids", _int_range(0, 10_000_000), 100_000,
             "Responses API conversations remembered per gateway replica: response id -> the pod that answered "
             "it (learned from the routed answer; shared with the other replicas through KVGATE_REDIS_URL), so "
             "a request with that `previous_response_id` goes to the engine that stored the conversation while "
             "it is ready. Least recently used first out; 0: not learned."),
    Variable("KVGATE_RESPONSE_ID_TTL_S", "response_id_ttl_s", _positive_float, 3600.0,
             "With KVGATE_REDIS_URL: how long a learned response id (KVGATE_RESPONSE_IDS) stays in Redis for "
             "the other gateway replicas (an id one replica did not learn is looked up there, one GET of at "
             "most 50 ms)."),
    Variable("KVGATE_TRACE_WRITE_INTERVAL_S", "trace_write_interval_s", _positive_float, 10.0,
             "With KVGATE_REDIS_URL: each model's request trace window (AIBrix's format, "
             "`aibrix:<model>_request_trace_<t>`) is written to Redis this often."),
    Variable("KVGATE_PREDICT_WINDOW_S", "predict_window_s", _positive_float, 240.0,
             "Output-length prediction: completed requests of the last this many seconds count (shared "
             "between replicas through KVGATE_REDIS_URL)..."),
    Variable("KVGATE_PREDICT_STEP_S", "predict_step_s", _positive_float, 10.0,
             "...the window advancing in steps of this long."),
    Variable("KVGATE_PREDICT_COLD_START", "predict_cold_start",
             _choice("optimistic", "random", "input", "pessimistic"), "optimistic",
             "Predicted output length with no history for the input's length: `optimistic` 1, `random` "
             "1..KVGATE_PREDICT_MAX_OUTPUT, `input` the input length, `pessimistic` KVGATE_PREDICT_MAX_OUTPUT."),
    Variable("KVGATE_PREDICT_MAX_OUTPUT", "predict_max_output", _int_range(1, 1 << 20), 4096,
             "Longest output the cold-start rules assume (tokens)."),
    Variable("KVGATE_SLO_TARGETS", "slo_targets", _slo_targets, "*=1000/100",
             "Default latency targets of the `slo` strategy, per model: `model=ttft_ms/tpot_ms,...` (`*`: any "
             "other model); a request's `x-slo-ttft-ms` / `x-slo-tpot-ms` headers take precedence."),
    Variable("KVGATE_ADMISSION_MAX_RUNNING", "admission_max_running", _int_range(0, 1_000_000), 0,
             "Most requests running on one pod over every replica, checked and counted atomically (Redis with "
             "KVGATE_REDIS_URL); a request finding every eligible pod full waits (0: no limit)..."),
    Variable("KVGATE_ADMISSION_MAX_WAIT_S", "admission_max_wait_s", _float_min(0.0), 3.0,
             "...in its model's queue (models take turns) for up to this long, then gets 429... Keep it plus "
             "KVGATE_TOKENIZER_TIMEOUT_S under Envoy's ext_proc `message_timeout` (5 s in the shipped configs): "
             "past that, Envoy answers 504 before kvgate's 429."),
    Variable("KVGATE_ADMISSION_RETRY_AFTER_S", "admission_retry_after_s", _int_range(0, 3600), 1,
             "...with this `Retry-After`."),
    Variable("KVGATE_ADMISSION_DELETED_KEEP_S", "admission_deleted_keep_s", _float_min(0.0), 30.0,
             "A pod that leaves discovery keeps its admitted count this long (re-created within it, the count stands)."),
    Variable("KVGATE_LOG_LEVEL", "log_level", _choice("debug", "info", "warning", "error"), "info",
             "Log level. `debug` adds a line per routing decision: each scorer's scores for each candidate, the "
             "blocks the index matched on each, the running counts and the pods the load guard set aside."),
)


@dataclass(frozen=True)
class Settings:
    listen_host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8080
    grpc_tls: str = "off"
    grpc_tls_cert: str = ""
    grpc_tls_key: str = ""
    grpc_server: str = "kvgate"
    grpc_keepalive_s: float = 30.0
    grpc_health_port: int = 0
    discovery: str = "static"
    pods_file: str = ""
    pods: str = ""
    k8s_namespace: str = ""
    k8s_label_selector: str = "model.aibrix.ai/name"
    k8s_api_url: str = ""
    inferencepool_name: str = ""
    pool_models_refresh_s: float = 30.0
    routing_strategy: str = "kv-sync"
    routing_weights: str = ""
    routing_guard_slack: int = 16
    routing_guard_ratio: float = 0.7
    routing_prefill_tokens_per_s: float = 10_000.0
    pd_threshold_tokens: int = 256
    pd_strategies: str = ""
    pd_prefill_timeout_s: float = 30.0
    session_ttl_s: float = 1800.0
    session_capacity: int = 100_000
    prefix_cache_block_size: int = 16
    prefix_cache_blocks: int = 200_000
    fallback_endpoints: int = 3
    sheddable_objectives: str = ""
    saturation_queue: float = 5.0
    saturation_kv_usage: float = 0.8
    engine_metrics_interval_s: float = 1.0
    pods_poll_s: float = 1.0
    redis_url: str = ""
    redis_key_ttl_s: float = 5.0
    gateway_id: str = ""
    tokenizer: str = "auto"
    tokenizer_path: str = ""
    tokenizer_hub: bool = False
    tokenizer_cache_dir: str = ""
    tokenizer_verify_requests: int = 5
    tokenizer_sample_rate: float = 0.05
    tokenizer_url: str = ""
    tokenizer_timeout_s: float = 1.0
    tokenizer_cache_mb: int = 256
    max_body_bytes: int = 8 << 20
    target_pod_header: bool = True
    index_max_entries: int = 4_000_000
    kv_events_backoff_min_s: float = 1.0
    kv_events_backoff_max_s: float = 30.0
    kv_events_replay_timeout_s: float = 0.5
    kv_events_heartbeat_s: float = 5.0
    kv_events_heartbeat_timeout_s: float = 15.0
    kv_events_rcv_hwm: int = 10_000
    kv_events_tick_budget_s: float = 0.002
    kv_events_coalesce_s: float = 0.025
    drain_delay_s: float = 3.0
    drain_timeout_s: float = 25.0
    observe_responses: bool = True
    observe_sample: float = 0.1
    watch_wait_s: float = 5.0
    response_ids: int = 100_000
    response_id_ttl_s: float = 3600.0
    trace_write_interval_s: float = 10.0
    predict_window_s: float = 240.0
    predict_step_s: float = 10.0
    predict_cold_start: str = "optimistic"
    predict_max_output: int = 4096
    slo_targets: str = "*=1000/100"
    admission_max_running: int = 0
    admission_max_wait_s: float = 3.0
    admission_retry_after_s: int = 1
    admission_deleted_keep_s: float = 30.0
    log_level: str = "info"

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "Settings":
        """Read every KVGATE_* variable; raise ConfigError naming the first bad one."""
        known = {v.env for v in VARIABLES}
        unknown = sorted(k for k in environ if k.startswith("KVGATE_") and k not in known)
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown variable (known: see README's table)")
        values: dict[str, Any] = {}
        for var in VARIABLES:
            raw = environ.get(var.env)
            if raw is None or (raw.strip() == "" and var.default != ""):
                continue
            try:
                values[var.field] = var.parse(raw)
            except ValueError as e:
                shown = "<hidden>" if var.secret else repr(raw)
                raise ConfigError(f"{var.env}={shown}: {e}") from None
        settings = cls(**values)
        settings._check()
        return settings

    def _check(self) -> None:
        try:
            parse_weights(self.routing_weights)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.discovery == "static" and not (self.pods_file or self.pods):
            raise ConfigError("KVGATE_PODS_FILE or KVGATE_PODS: one is required with KVGATE_DISCOVERY=static")
        if self.discovery == "inferencepool" and not self.inferencepool_name:
            raise ConfigError("KVGATE_INFERENCEPOOL_NAME: required with KVGATE_DISCOVERY=inferencepool")
        if self.tokenizer == "local" and not self.tokenizer_path:
            raise ConfigError("KVGATE_TOKENIZER_PATH: required with KVGATE_TOKENIZER=local")
        if self.kv_events_backoff_max_s < self.kv_events_backoff_min_s:
            raise ConfigError("KVGATE_KV_EVENTS_BACKOFF_MAX_S: must be at least KVGATE_KV_EVENTS_BACKOFF_MIN_S")
        if self.grpc_port and self.grpc_port == self.http_port:
            raise ConfigError("KVGATE_HTTP_PORT: must differ from KVGATE_GRPC_PORT")
        if self.grpc_health_port and self.grpc_health_port in (self.grpc_port, self.http_port):
            raise ConfigError("KVGATE_GRPC_HEALTH_PORT: must differ from KVGATE_GRPC_PORT and KVGATE_HTTP_PORT")
        if self.grpc_tls == "files" and not (self.grpc_tls_cert and self.grpc_tls_key):
            raise ConfigError("KVGATE_GRPC_TLS_CERT and KVGATE_GRPC_TLS_KEY: both required with KVGATE_GRPC_TLS=files")
        if self.grpc_tls != "files" and (self.grpc_tls_cert or self.grpc_tls_key):
            raise ConfigError("KVGATE_GRPC_TLS_CERT/KEY: set only with KVGATE_GRPC_TLS=files")

    def redacted(self) -> dict[str, Any]:
        """Settings for logs and the debug endpoint, with secrets hidden."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("redis_url", "tokenizer_url", "k8s_api_url"):
            out[name] = redact_url(out[name])
        return out


def markdown_table() -> str:
    rows = ["| Variable | Default | Meaning |", "|---|---|---|"]
    for var in VARIABLES:
        default = var.default
        shown = "(empty)" if default == "" else (str(default).lower() if isinstance(default, bool) else str(default))
        rows.append(f"| `{var.env}` | `{shown}` | {var.help} |")
    return "\n".join(rows)


def _self_check() -> None:
    names = [f.name for f in fields(Settings)]
    assert names == [v.field for v in VARIABLES], "Settings fields and VARIABLES must list the same names in order"
    for var in VARIABLES:
        assert getattr(Settings, var.field) == var.default, var.env


_self_check()

# README sections generated from the tables they document: marker name -> text
GENERATED = {"config-table": markdown_table, "strategy-table": markdown_tables}


def write_readme_table(readme: str) -> None:
    """Replace each generated section (between `<!-- name` and `<!-- end name -->`) of the README."""
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    for marker, make in GENERATED.items():
        start = text.index(f"<!-- {marker}")
        start = text.index("\n", start) + 1
        end = text.index(f"<!-- end {marker} -->")
        text = text[:start] + make() + "\n" + text[end:]
    with open(readme, "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    # `python -m plugin.config` prints the table; `python -m plugin.config README.md` rewrites it there.
    if len(sys.argv) > 1:
        write_readme_table(sys.argv[1])
    else:
        print(markdown_table())
    sys.exit(0)
