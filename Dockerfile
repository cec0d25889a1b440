# Querator server image: `docker build -t querator .` from the repository root.
# Data lives in the /data volume; gRPC on 2319, Prometheus metrics on 9090 (/metrics),
# the latter on the container's loopback only: metrics name every queue, so reaching
# them from outside is opted into (docs/operations.md, "Metrics": set
# QUERATOR_METRICS_ADDRESS=0.0.0.0:9090, with QUERATOR_METRICS_TOKEN on a shared network).
# server/tests/test_container.py runs this file's ENTRYPOINT + CMD with its ENV (and
# the HEALTHCHECK command) against a temp data dir, so keep them plain.
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

COPY clients/proto /tmp/src/clients/proto
COPY clients/python /tmp/src/clients/python
COPY server /tmp/src/server
RUN pip install /tmp/src/clients/proto /tmp/src/clients/python '/tmp/src/server[cluster]' && rm -rf /tmp/src

RUN useradd --system --uid 10001 --user-group --home-dir /data --no-create-home querator \
    && mkdir -p /data \
    && chown querator:querator /data \
    && chmod 700 /data

ENV QUERATOR_DATA_DIR=/data \
    QUERATOR_METRICS_ADDRESS=127.0.0.1:9090 \
    QUERATOR_LOG_LEVEL=info

VOLUME ["/data"]
WORKDIR /data
USER querator
EXPOSE 2319 9090

HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; c = grpc.insecure_channel('127.0.0.1:2319'); s = g.HealthStub(c).Check(h.HealthCheckRequest(), timeout=3).status; sys.exit(0 if s == h.HealthCheckResponse.SERVING else 1)"]

# SIGTERM (docker stop) drains the queues and exits 0; give it more than the
# server's 10 s shutdown grace (docker stop -t 30, compose stop_grace_period).
STOPSIGNAL SIGTERM
ENTRYPOINT ["querator"]
CMD ["serve", "--address", "0.0.0.0:2319"]
