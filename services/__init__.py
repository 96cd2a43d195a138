"""The pipeline's services (rollout, tools, scorer, trainer) and the shared pieces they
run on: the bus (Redis Streams), telemetry, a private local Redis for one machine."""
