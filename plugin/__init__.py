"""The ext_proc server, its request pipeline, the `kvgate` command line and the configuration: the
layer that wires kvcache/, tokenizer/ and routing/ together behind Envoy.

It may import every other kvgate package; nothing imports it.

    extproc     the ext_proc protocol alone: message dispatch, body modes, EPP clauses, ProcessingResponses
    pipeline    the request pipeline: a request's context and its named steps (parse, tokenize, pick, admit,
                record, observe); `Gateway`, what the processor and the pipeline need
    request     OpenAI request bodies -> typed inference requests, and the client errors they raise
    admit       the request path's side of admission: the admitted pod, or 429 after the wait
    observe     watching routed responses: TTFT, TPOT, tokens; fed to Prometheus and the request trackers
    watch       watching from a stream Envoy never waits on (the watched routes): its reading, and the words
                to the replica that routed the request (in-process or through Redis)
    metrics     the gateway's own Prometheus metrics
    throttle    a recurring failure logged at most once per interval
    app         wiring: Settings -> discovery, index, subscriptions, tokenizer, router, gRPC and HTTP servers
    config      every KVGATE_* variable, read once at start-up
    tls         TLS on the gRPC port (KVGATE_GRPC_TLS): a configured or a self-signed certificate
    http        the HTTP port: /metrics, /healthz, /debug, the status page /
    status      what the status page shows beyond the router's snapshot: the routing mix per minute, recent errors
    statusview  one replica's /debug -> the status page's HTML or `kvgate status`'s text
    status_cmd  `kvgate status`: that view in the terminal, for one replica or a Service's all
    serve       `kvgate serve`
    events_cmd  `kvgate events`: tail one engine's KV events
    cli         the `kvgate` command and its subcommands
"""
