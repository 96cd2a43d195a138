"""Prometheus metrics of the evidence scorer: its speed and the health of PBSD's credit signal."""

from prometheus_client import Counter, Gauge, Histogram

from proto.sanity import ACTION_CLASSES, TURN_KINDS

GROUPS = Counter(
    "pbsd_scorer_groups_total", "Groups handled, scored (PBSD) or passed through (GRPO)", ["kind"]
)
ENDED_RUN_GROUPS = Counter(
    "pbsd_scorer_ended_run_groups_total", "Groups dropped unscored because their run had ended"
)
SCORED_TOKENS = Counter(
    "pbsd_scorer_scored_tokens_total", "Tokens whose student or teacher log-prob was computed"
)
UNALIGNED_TOKENS = Counter(
    "pbsd_scorer_unaligned_tokens_total", "Loss tokens without a teacher position (x* cut)"
)
SECONDS = Histogram(
    "pbsd_scorer_group_seconds",
    "Time to score one group",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
TURNS = Counter(
    "pbsd_scorer_turns_total", "Assistant turns seen, by outcome", ["outcome"]
)  # scored/filtered/unscored
TEACHER_HIGHER = Gauge(
    "pbsd_scorer_teacher_higher_fraction", "Last group: fraction of scored turns with s > 0"
)
MEAN_ABS_GAP = Gauge("pbsd_scorer_mean_abs_gap", "Last group: mean |s| over scored turns")
FILTERED = Gauge("pbsd_scorer_filtered_fraction", "Last group: fraction of scored turns inside the deadband")
EVIDENCE = Histogram(
    "pbsd_scorer_evidence",
    "Per-turn evidence s = mean teacher - student log-prob",
    buckets=(-1, -0.3, -0.1, -0.03, -0.01, -0.003, -0.001, 0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1),
)
WEIGHTS = Histogram(
    "pbsd_scorer_turn_weight",
    "Per-turn weight w",
    buckets=(0.9, 0.92, 0.94, 0.96, 0.98, 0.999, 1.001, 1.02, 1.04, 1.06, 1.08, 1.1),
)
POLICY_VERSION = Gauge("pbsd_scorer_policy_version", "Policy version the scorer's weights are at")

# The teacher sanity figures and the noise floor as counters (proto.sanity), so that a dashboard's
# rate() over a window gives their exact value over every replica's groups in it.
SANITY_KINDS = (*TURN_KINDS, *ACTION_CLASSES)
SANITY_TURNS = Counter(
    "pbsd_scorer_sanity_turns_total",
    "Scored turns by kind (answer_free, correct_final, queries/grounded, ...) and band "
    "(above: s > eps+, below: s < -eps-, deadband)",
    ["kind", "band"],
)
SANITY_EVIDENCE = Counter(
    "pbsd_scorer_sanity_evidence_total",
    "Sum of the positive (sign=positive) and of minus the negative (sign=negative) s of scored turns, by kind",
    ["kind", "sign"],
)
NOISE_TOKENS = Counter("pbsd_scorer_noise_tokens_total", "Loss tokens scored again in the null pass")
NOISE_SQUARES = Counter(
    "pbsd_scorer_noise_squared_difference_total", "Sum of (null - student log-prob)^2 over null-pass tokens"
)
NOISE_TURNS = Counter(
    "pbsd_scorer_noise_turns_total",
    "Null-pass turns, by whether their s lies outside the deadband",
    ["outcome"],
)
for _kind in SANITY_KINDS:  # every series exists from the start, at 0
    for _band in ("above", "deadband", "below"):
        SANITY_TURNS.labels(_kind, _band)
    for _sign in ("positive", "negative"):
        SANITY_EVIDENCE.labels(_kind, _sign)
for _outcome in ("inside", "outside"):
    NOISE_TURNS.labels(_outcome)
