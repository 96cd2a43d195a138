# syntax=docker/dockerfile:1.7
# The rollout service. BASE is pbsd-base:cpu or pbsd-base:cuda (deploy/docker/base.Dockerfile):
#   docker build -f deploy/docker/rollout.Dockerfile --build-arg BASE=pbsd-base:cpu -t pbsd-rollout:cpu .
ARG BASE=pbsd-base:cpu
FROM ${BASE}
ENV PBSD_ROLLOUT_HOST=0.0.0.0 PBSD_ROLLOUT_PORT=8002
EXPOSE 8002
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=6 \
    CMD curl -fsS http://127.0.0.1:8002/health || exit 1
CMD ["pbsd", "serve", "rollout"]
