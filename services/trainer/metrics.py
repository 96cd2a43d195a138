"""Prometheus metrics of the trainer: the training dynamics the paper plots, and the pipeline's health."""

from prometheus_client import Counter, Gauge, Histogram

from proto.sanity import ACTION_CLASSES

STEP = Gauge("pbsd_trainer_step", "Optimiser steps taken in the current run")
POLICY_VERSION = Gauge("pbsd_trainer_policy_version", "Latest published policy version")
LOSS = Gauge("pbsd_trainer_loss", "Policy loss of the last step")
CLIP_FRAC = Gauge("pbsd_trainer_clip_fraction", "Fraction of loss tokens clipped in the last step")
GRAD_NORM = Gauge("pbsd_trainer_grad_norm", "Gradient norm before clipping, last step")
VAL_ACCURACY = Gauge("pbsd_trainer_val_accuracy", "mean@k on the run's validation questions, last round")
KL_REF = Gauge(
    "pbsd_trainer_kl_ref", "Mean per-token KL to the reference policy, last step (runs with kl_coef > 0)"
)
REWARD = Gauge("pbsd_trainer_reward_mean", "Mean reward of the last batch")
ACCURACY = Gauge("pbsd_trainer_accuracy", "Fraction of correct trajectories in the last batch")
TURNS = Gauge("pbsd_trainer_turns_per_trajectory", "Mean assistant turns per trajectory, last batch")
TOKENS = Gauge("pbsd_trainer_tokens_per_trajectory", "Mean tokens per trajectory, last batch")
GENERATED = Gauge(
    "pbsd_trainer_generated_tokens_per_trajectory", "Mean generated tokens per trajectory, last batch"
)
TEACHER_HIGHER = Gauge(
    "pbsd_trainer_teacher_higher_fraction", "Fraction of scored turns with teacher > student, last batch"
)
MEAN_ABS_GAP = Gauge("pbsd_trainer_mean_abs_gap", "Mean |s| over scored turns, last batch")
FILTERED = Gauge("pbsd_trainer_filtered_fraction", "Fraction of scored turns in the deadband, last batch")
GROUNDED_SEARCHES = Gauge(
    "pbsd_trainer_grounded_searches_fraction",
    "Fraction of searches in the last batch whose names all come from the question or earlier results",
)
GROUNDED_READS = Gauge(
    "pbsd_trainer_grounded_reads_fraction",
    "Fraction of page reads in the last batch whose URL an earlier result gave",
)
GROUNDED_ANSWERS = Gauge(
    "pbsd_trainer_grounded_answers_fraction",
    "Fraction of boxed answers in the last batch found in a tool result",
)
# does the teacher read x* (proto.sanity; docs/credit-signal.md)
ANSWER_FREE = Gauge(
    "pbsd_trainer_answer_free_evidence_mean",
    "Mean s over the last batch's scored turns whose text does not contain the answer (should sit "
    "inside the deadband)",
)
CORRECT_FAVOURED = Gauge(
    "pbsd_trainer_correct_final_favoured_fraction",
    "Fraction of the last batch's correct final answers with s > eps+",
)
CORRECT_ROOM = Gauge(
    "pbsd_trainer_correct_final_room_fraction",
    "Fraction of the last batch's correct final answers that any teacher could favour: the student's "
    "mean log-prob over the turn is below -eps+ (the rest are written with near certainty)",
)
WRONG_DISFAVOURED = Gauge(
    "pbsd_trainer_wrong_final_disfavoured_fraction",
    "Fraction of the last batch's wrong final answers with s < -eps-",
)
ACTION_EVIDENCE = Gauge(
    "pbsd_trainer_action_evidence_mean",
    "Mean s of the last batch's searches, reads and answers, grounded or made up",
    ["action", "grounded"],
)
NOISE_STD = Gauge(
    "pbsd_trainer_noise_floor_std",
    "Per-token std of the null pass (student tokens scored again in the teacher's layout), last batch",
)
NOISE_OUTSIDE = Gauge(
    "pbsd_trainer_noise_outside_deadband_fraction",
    "Fraction of null-pass turns whose s lies outside the deadband, last batch",
)
WITHIN_FLOOR = Gauge(
    "pbsd_trainer_within_noise_floor_fraction",
    "Fraction of the last batch's scored turns whose |s| lies within the measured noise floor",
)
TOKENS_PER_S = Gauge(
    "pbsd_trainer_train_tokens_per_second", "Loss tokens trained per second of optimiser work"
)
STEP_SECONDS = Histogram(
    "pbsd_trainer_step_seconds",
    "Wall time from one step to the next",
    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600),
)
WAIT_SECONDS = Histogram(
    "pbsd_trainer_wait_seconds",
    "Time spent waiting for a batch of scored groups",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
)
STALENESS = Histogram(
    "pbsd_trainer_staleness",
    "Policy version minus the version a trained group was sampled with",
    buckets=(0, 1, 2, 3, 4, 8),
)
DROPPED = Counter("pbsd_trainer_dropped_groups_total", "Scored groups not trained on, by reason", ["reason"])
DROP_REASONS = (
    "foreign",
    "lost",
    "future",
    "stale",
    "duplicate",
    "dead_lettered",
    "malformed",
)  # services/trainer/admission.py
for _reason in DROP_REASONS:  # at zero from the start: a panel shows 0 drops, not "no data"
    DROPPED.labels(_reason)
GROUPS = Counter("pbsd_trainer_trained_groups_total", "Scored groups trained on")
SKIPPED_UPDATES = Counter(
    "pbsd_trainer_skipped_updates_total",
    "Optimiser updates skipped: the gradient was not finite (or, under DeepSpeed's fp16, "
    "the loss scale overflowed)",
)


# a step record's key -> the gauge that shows it (keys a step lacks leave their gauge as it was)
STEP_GAUGES = {
    "step": STEP,
    "loss": LOSS,
    "clip_frac": CLIP_FRAC,
    "grad_norm": GRAD_NORM,
    "kl_ref": KL_REF,
    "reward_mean": REWARD,
    "accuracy": ACCURACY,
    "turns_mean": TURNS,
    "tokens_mean": TOKENS,
    "generated_tokens_mean": GENERATED,
    "teacher_higher_frac": TEACHER_HIGHER,
    "mean_abs_gap": MEAN_ABS_GAP,
    "filtered_frac": FILTERED,
    "train_tokens_per_s": TOKENS_PER_S,
    "grounded_queries_frac": GROUNDED_SEARCHES,
    "grounded_reads_frac": GROUNDED_READS,
    "grounded_answers_frac": GROUNDED_ANSWERS,
    "answer_free_mean_s": ANSWER_FREE,
    "correct_final_favoured_frac": CORRECT_FAVOURED,
    "correct_final_room_frac": CORRECT_ROOM,
    "wrong_final_disfavoured_frac": WRONG_DISFAVOURED,
    "noise_std": NOISE_STD,
    "noise_outside_deadband_frac": NOISE_OUTSIDE,
    "within_noise_floor_frac": WITHIN_FLOOR,
}
for _action in ACTION_CLASSES:  # evidence_queries_grounded_mean_s -> {action="queries", grounded="true"}
    _kind, _how = _action.split("/")
    STEP_GAUGES[f"evidence_{_kind}_{_how.replace('-', '_')}_mean_s"] = ACTION_EVIDENCE.labels(
        _kind, str(_how == "grounded").lower()
    )


# the teacher's figures: a GRPO step has none, so a gauge left at a PBSD run's last value would speak
# for the next run, or for none (an alert on answer-free evidence fired for good about a run that
# was over)
TEACHER_KEYS = frozenset(
    k
    for k in STEP_GAUGES
    if k.startswith(("evidence_", "noise_", "correct_", "wrong_", "answer_free", "within_"))
) | {"teacher_higher_frac", "mean_abs_gap", "filtered_frac"}


def forget_teacher_figures() -> None:
    """The teacher's gauges to NaN (no figure) as a run ends: Prometheus then has no value to alert on."""
    for key in TEACHER_KEYS:
        STEP_GAUGES[key].set(float("nan"))


def export_step(record: dict[str, float]) -> None:
    """A step's record as the gauges, the step-time histogram and the skipped-update count."""
    for key, gauge in STEP_GAUGES.items():
        if key in record:
            gauge.set(record[key])
    STEP_SECONDS.observe(record["step_s"])
    if record.get("skipped_update"):  # a count: a step of several updates may skip more than one
        SKIPPED_UPDATES.inc(record["skipped_update"])


PUBLISH_SECONDS = Histogram(
    "pbsd_trainer_publish_seconds",
    "Seconds to hand a policy version to the consumers, by transport (disk: write the checkpoint; "
    "broadcast: the in-memory update of every member of the weight group)",
    ["transport"],
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
)
for _transport in ("disk", "broadcast"):  # both series exist before the first publication
    PUBLISH_SECONDS.labels(_transport)
