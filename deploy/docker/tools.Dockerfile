# syntax=docker/dockerfile:1.7
# The tools service. BASE is pbsd-base:cpu or pbsd-base:cuda (deploy/docker/base.Dockerfile):
#   docker build -f deploy/docker/tools.Dockerfile --build-arg BASE=pbsd-base:cpu -t pbsd-tools:cpu .
ARG BASE=pbsd-base:cpu
FROM ${BASE}
ENV PBSD_TOOLS_HOST=0.0.0.0 PBSD_TOOLS_PORT=8001
EXPOSE 8001
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=6 \
    CMD curl -fsS http://127.0.0.1:8001/health || exit 1
CMD ["pbsd", "serve", "tools"]
