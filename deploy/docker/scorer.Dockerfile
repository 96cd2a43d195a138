# syntax=docker/dockerfile:1.7
# The scorer service. BASE is pbsd-base:cpu or pbsd-base:cuda (deploy/docker/base.Dockerfile):
#   docker build -f deploy/docker/scorer.Dockerfile --build-arg BASE=pbsd-base:cpu -t pbsd-scorer:cpu .
ARG BASE=pbsd-base:cpu
FROM ${BASE}
ENV PBSD_SCORER_HOST=0.0.0.0 PBSD_SCORER_PORT=8003
EXPOSE 8003
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=6 \
    CMD curl -fsS http://127.0.0.1:8003/health || exit 1
CMD ["pbsd", "serve", "scorer"]
