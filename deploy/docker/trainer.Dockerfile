# syntax=docker/dockerfile:1.7
# The trainer service. BASE is pbsd-base:cpu or pbsd-base:cuda (deploy/docker/base.Dockerfile):
#   docker build -f deploy/docker/trainer.Dockerfile --build-arg BASE=pbsd-base:cpu -t pbsd-trainer:cpu .
ARG BASE=pbsd-base:cpu
FROM ${BASE}
ENV PBSD_TRAINER_HOST=0.0.0.0 PBSD_TRAINER_PORT=8000
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=6 \
    CMD curl -fsS http://127.0.0.1:8000/health || exit 1
CMD ["pbsd", "serve", "trainer"]
