"""Time `kvgate serve` spends tokenizing per routed request (kvgate_tokenize_seconds), on the engines'
/tokenize (`remote`) or on the verified local path (`auto` with the sims' tokenizer files).

    python -m bench.tokenize_path remote|auto [REQUESTS]

Stack on loopback: 2 sims, kvgate serve (kv-sync), Envoy. 20 warm-up requests (in `auto`, the local path
is verified on them), then REQUESTS (default 300) chat requests, 4 at a time, each a new user's first turn
(the demo's shape: a group's 150-word system prompt and a new 30-word question, so never cached whole).
Prints one JSON line: tokenize time per request (mean, and the histogram bucket holding p50 / p90),
requests/s, the tokenizer paths taken and the /tokenize calls made (background samples included).
"""
import asyncio
import json
import re
import sys
import time

import httpx

from devkit.stack import Stack, free_port
from devkit.workload import ChatWorkload, WorkloadShape
from tokenizer import testdata

MODEL = "m"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 300

def _le(bucket_key: str) -> float:
    """The `le` bound of a histogram bucket's sample key."""
    found = re.search(r'le="([^"]+)"', bucket_key)
    assert found is not None, bucket_key
    return float(found.group(1))


def metric(text, name):
    out = {}
    for line in text.splitlines():
        if line.startswith(name):
            out[line.split(" ")[0]] = float(line.rsplit(" ", 1)[1])
    return out

async def drive(url, n, seed):
    w = ChatWorkload(WorkloadShape(), MODEL, seed=seed)
    q = list(range(n))
    async with httpx.AsyncClient(timeout=60) as c:
        async def worker():
            while q:
                i = q.pop()
                user = (i % 6, i)  # a new user each time: never-seen prompt (shared system prompt per group)
                msgs = w.next_messages(user)
                r = await c.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 1},
                                 headers={"routing-strategy": "kv-sync"})
                r.raise_for_status()
        await asyncio.gather(*(worker() for _ in range(4)))

def main(mode):
    env_extra = {"remote": {"KVGATE_TOKENIZER": "remote"},
                 "auto": {"KVGATE_TOKENIZER": "auto", "KVGATE_TOKENIZER_PATH": str(testdata.path())}}[mode]
    with Stack() as stack:
        pods = stack.engines(2, model=MODEL)
        grpc, http = free_port(), free_port()
        stack.kvgate(env={"KVGATE_PODS_FILE": str(stack.pods_file(pods)), "KVGATE_GRPC_PORT": str(grpc),
                          "KVGATE_HTTP_PORT": str(http), "KVGATE_LOG_LEVEL": "warning", **env_extra}, grpc_port=grpc)
        listen = free_port()
        stack.envoy(listen_port=listen, extproc_port=grpc, pool=[("127.0.0.1", p["port"]) for p in pods])
        url = f"http://127.0.0.1:{listen}"
        asyncio.run(drive(url, 20, seed=99))  # warm-up (and verification in auto mode)
        time.sleep(0.5)
        before = metric(httpx.get(f"http://127.0.0.1:{http}/metrics").text, "kvgate_tokenize_seconds")
        t0 = time.monotonic()
        asyncio.run(drive(url, N, seed=1))
        el = time.monotonic() - t0
        m = httpx.get(f"http://127.0.0.1:{http}/metrics").text
        after = metric(m, "kvgate_tokenize_seconds")
        s = after["kvgate_tokenize_seconds_sum"] - before["kvgate_tokenize_seconds_sum"]
        n = after["kvgate_tokenize_seconds_count"] - before["kvgate_tokenize_seconds_count"]
        buckets = {k: after[k] - before.get(k, 0) for k in after if "_bucket" in k}
        # p50 from buckets
        p50 = next(_le(k) for k, v in buckets.items() if v >= n / 2)
        p90 = next(_le(k) for k, v in buckets.items() if v >= n * 0.9)
        paths = metric(m, "kvgate_tokenizer_path_requests_total")
        attempts = metric(m, "kvgate_tokenizer_remote_attempts_total")
        print(json.dumps({"mode": mode, "requests": n, "tokenize_mean_ms": round(s / n * 1000, 3),
                          "tokenize_p50_le_ms": p50 * 1000, "tokenize_p90_le_ms": p90 * 1000,
                          "req_per_s": round(N / el, 1), "paths": paths, "remote_attempts": attempts}))

if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "auto")
