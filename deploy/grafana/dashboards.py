"""The Grafana dashboards, written as code: ``python deploy/grafana/dashboards.py`` rewrites
``deploy/grafana/dashboards/*.json`` (a test fails when the JSON and this file disagree).

Four dashboards, each panel one question an operator asks:

* pipeline  is rollout, scoring or training the bottleneck; is anything stuck or dropped
* credit    is PBSD's per-turn credit healthy, and is the agent learning
* tools     are search and page reads fast, cached and succeeding
* sglang    the inference server's own ``sglang:`` series

Only Prometheus series the services export are used (tests/test_deploy_metrics.py scrapes running
services and compares).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DATASOURCE = {"type": "prometheus", "uid": "pbsd-prometheus"}
OUT = Path(__file__).resolve().parent / "dashboards"


def _target(expr: str, legend: str, ref: str, *, fmt: str | None = None) -> dict:
    target = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref}
    if fmt:
        target["format"] = fmt
    return target


def panel(
    title: str,
    description: str,
    queries: list[tuple[str, str]],
    *,
    unit: str = "short",
    kind: str = "timeseries",
    fmt: str | None = None,
    min_: float | None = None,
    max_: float | None = None,
    thresholds: list[tuple[str, float | None]] | None = None,
) -> dict:
    defaults: dict = {"unit": unit}
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    if thresholds:
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [{"color": color, "value": value} for color, value in thresholds],
        }
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"showLegend": True, "displayMode": "list", "placement": "bottom"}}
        if kind == "timeseries"
        else {},
        "targets": [
            _target(expr, legend, chr(ord("A") + i), fmt=fmt) for i, (expr, legend) in enumerate(queries)
        ],
    }


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def dashboard(uid: str, title: str, description: str, items: list[dict]) -> dict:
    """Lay panels out two per row (rows span the width) and number them."""
    x = y = 0
    for i, item in enumerate(items, start=1):
        item["id"] = i
        if item["type"] == "row":
            if x:
                x, y = 0, y + 8
            item["gridPos"] = {"x": 0, "y": y, "w": 24, "h": 1}
            y += 1
            continue
        item["gridPos"] = {"x": x, "y": y, "w": 12, "h": 8}
        x = 12 if x == 0 else 0
        if x == 0:
            y += 8
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["pbsd"],
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "utc",
        "panels": items,
        "templating": {"list": []},
        "annotations": {"list": []},
    }


def _mean(histogram: str, window: str = "5m", by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum(rate({histogram}_sum[{window}])){group} / sum(rate({histogram}_count[{window}])){group}"


def _quantile(q: float, histogram: str, window: str = "5m", by: str = "") -> str:
    extra = f", {by}" if by else ""
    return f"histogram_quantile({q}, sum(rate({histogram}_bucket[{window}])) by (le{extra}))"


def _band(kind: str, band: str, window: str = "10m") -> str:
    """The fraction of the scorer's turns of ``kind`` in ``band`` over the window (all replicas)."""
    turns = "pbsd_scorer_sanity_turns_total"
    return f'sum(rate({turns}{{kind="{kind}",band="{band}"}}[{window}])) / sum(rate({turns}{{kind="{kind}"}}[{window}]))'


def _sanity_mean(kind: str, window: str = "10m") -> str:
    """The scorer's mean s of turns of ``kind`` over the window: (positive - negative sums) / turns."""
    evidence = "pbsd_scorer_sanity_evidence_total"
    return (
        f'(sum(rate({evidence}{{kind="{kind}",sign="positive"}}[{window}])) - '
        f'sum(rate({evidence}{{kind="{kind}",sign="negative"}}[{window}]))) / '
        f'sum(rate(pbsd_scorer_sanity_turns_total{{kind="{kind}"}}[{window}]))'
    )


def pipeline() -> dict:
    return dashboard(
        "pbsd-pipeline",
        "pbsd pipeline",
        "Where the work waits: rollout (prompts), scoring (trajectories) or training (scored).",
        [
            row("Queues between the stages"),
            panel(
                "Consumer lag per stage",
                "Entries not yet delivered to the stage's consumer group. Growing lag on prompts: "
                "rollout is the bottleneck; on trajectories: the scorer; on scored: the trainer.",
                [("pbsd_stream_lag", "{{stream}} -> {{group}}")],
            ),
            panel(
                "Pending (in progress) per stage",
                "Delivered but not acknowledged: work in the hands of a consumer. Pending that stays "
                "high while throughput is zero means a consumer died; XAUTOCLAIM hands it on.",
                [("pbsd_stream_pending", "{{stream}} -> {{group}}")],
            ),
            panel(
                "Stream length",
                "Entries on each stream, acknowledged history included until it is trimmed. "
                "dead-letters should stay at zero.",
                [("pbsd_stream_length", "{{stream}}")],
            ),
            panel(
                "Oldest unacknowledged entry",
                "Age of the oldest pending entry per stage: how long one item has been in a stage.",
                [("pbsd_stream_oldest_pending_seconds", "{{stream}} -> {{group}}")],
                unit="s",
            ),
            row("Throughput and time per stage"),
            panel(
                "Throughput per stage",
                "Messages handled per second by each stage's consumer group (a prompt, a group of G "
                "trajectories, a scored group).",
                [("sum(rate(pbsd_bus_processed_total[1m])) by (stream)", "{{stream}}")],
                unit="ops",
            ),
            panel(
                "Time in each stage's handler",
                "Mean seconds a consumer spends on one message: a rollout group, a scoring pass, "
                "the trainer taking a scored group.",
                [(_mean("pbsd_bus_handler_seconds", by="stream"), "{{stream}}")],
                unit="s",
            ),
            panel(
                "Step time and waiting",
                "Wall time per optimiser step, and how much of it the trainer spent waiting for "
                "scored groups (waiting close to the step time: the trainer is starved).",
                [
                    (_mean("pbsd_trainer_step_seconds", "15m"), "step (mean)"),
                    (_quantile(0.9, "pbsd_trainer_step_seconds", "15m"), "step (p90)"),
                    (_mean("pbsd_trainer_wait_seconds", "15m"), "waiting for a batch (mean)"),
                ],
                unit="s",
            ),
            panel(
                "Tokens per second",
                "Generated by the rollout workers, and trained on by the trainer.",
                [
                    ("sum(rate(pbsd_rollout_generated_tokens_total[1m]))", "generated"),
                    ("sum(rate(pbsd_scorer_scored_tokens_total[1m]))", "scored (student + teacher)"),
                    ("pbsd_trainer_train_tokens_per_second", "trained"),
                ],
                unit="short",
            ),
            panel(
                "Trajectories per second by finish reason",
                "answer is the healthy ending; max_turns, max_context and error show the limits biting.",
                [("sum(rate(pbsd_rollout_trajectories_total[5m])) by (finish)", "{{finish}}")],
                unit="ops",
            ),
            panel(
                "Generation call latency",
                "One call to the engine (SGLang or in-process): median and p95.",
                [
                    (_quantile(0.5, "pbsd_rollout_engine_seconds"), "p50"),
                    (_quantile(0.95, "pbsd_rollout_engine_seconds"), "p95"),
                ],
                unit="s",
            ),
            row("Off-policyness, drops and failures"),
            panel(
                "Policy versions",
                "The trainer's latest version and the versions the rollout workers and scorers hold; "
                "the gap is how far behind the samplers are.",
                [
                    ("pbsd_trainer_policy_version", "trainer"),
                    ("pbsd_rollout_policy_version", "rollout {{instance}}"),
                    ("pbsd_scorer_policy_version", "scorer {{instance}}"),
                ],
            ),
            panel(
                "Staleness of trained groups",
                "Policy version at training minus the version that sampled the group (bounded by "
                "rollout.max_staleness), and prompts held back waiting for newer weights.",
                [
                    (_mean("pbsd_trainer_staleness", "15m"), "mean"),
                    (_quantile(0.99, "pbsd_trainer_staleness", "15m"), "p99"),
                    ("sum(pbsd_rollout_waiting_for_weights)", "prompts waiting for weights"),
                ],
            ),
            panel(
                "Dropped groups and dead letters",
                "Groups the trainer did not train on, by reason (stale, lost, future, duplicate, foreign), and "
                "entries moved to the dead-letter stream, by cause.",
                [
                    (
                        "sum(increase(pbsd_trainer_dropped_groups_total[15m])) by (reason)",
                        "dropped: {{reason}}",
                    ),
                    (
                        "sum(increase(pbsd_bus_dead_lettered_total[15m])) by (stream, reason)",
                        "dead letter: {{stream}} {{reason}}",
                    ),
                ],
                unit="short",
            ),
            panel(
                "Handler errors, reclaims and duplicates",
                "Retries in progress (errors), entries taken over from silent consumers, and "
                "redeliveries absorbed by idempotency.",
                [
                    ("sum(rate(pbsd_bus_handler_errors_total[5m])) by (stream)", "errors {{stream}}"),
                    ("sum(rate(pbsd_bus_reclaimed_total[5m])) by (stream)", "reclaimed {{stream}}"),
                    ("sum(rate(pbsd_bus_duplicates_total[5m])) by (stream)", "duplicates {{stream}}"),
                ],
                unit="ops",
            ),
        ],
    )


def credit() -> dict:
    return dashboard(
        "pbsd-credit",
        "pbsd credit (PBSD)",
        "The turn-level credit signal of PBSD (evidence s, weights w) and the learning curves.",
        [
            row("Learning"),
            panel(
                "Reward and accuracy",
                "Mean reward and the fraction of correct trajectories in the last trained batch, and "
                "mean@k on the validation questions at the last evaluation round (runs with "
                "data.validation).",
                [
                    ("pbsd_trainer_reward_mean", "reward"),
                    ("pbsd_trainer_accuracy", "accuracy"),
                    ("pbsd_trainer_val_accuracy", "validation mean@k"),
                ],
                unit="percentunit",
                min_=0,
                max_=1,
            ),
            panel(
                "Grounded searches, reads and answers",
                "Of the last batch's searches, page reads and boxed answers, the fraction taken from what "
                "the agent had read: every name in a query from the question or an earlier result, a URL "
                "from an earlier result, an answer found in a result. A small policy gets the tool format "
                "right long before it stops making names up; this moves before accuracy does.",
                [
                    ("pbsd_trainer_grounded_searches_fraction", "searches"),
                    ("pbsd_trainer_grounded_reads_fraction", "reads"),
                    ("pbsd_trainer_grounded_answers_fraction", "answers"),
                ],
                unit="percentunit",
                min_=0,
                max_=1,
            ),
            panel(
                "Turns and tokens per trajectory",
                "Assistant turns, and tokens (all, and generated) per trajectory in the last batch. "
                "Search agents that learn tend to search longer.",
                [
                    ("pbsd_trainer_turns_per_trajectory", "turns"),
                    ("pbsd_trainer_tokens_per_trajectory", "tokens"),
                    ("pbsd_trainer_generated_tokens_per_trajectory", "generated tokens"),
                ],
            ),
            panel(
                "Policy loss, clipping, gradient norm",
                "The clipped surrogate loss, the fraction of tokens outside the trust region, the "
                "gradient norm before clipping, and the mean per-token KL to the initial policy "
                "(runs with kl_coef > 0; the paper uses none).",
                [
                    ("pbsd_trainer_loss", "loss"),
                    ("pbsd_trainer_clip_fraction", "clip fraction"),
                    ("pbsd_trainer_grad_norm", "grad norm"),
                    ("pbsd_trainer_kl_ref", "KL to reference"),
                ],
            ),
            row("PBSD's evidence and weights"),
            panel(
                "Teacher-higher fraction",
                "Fraction of scored turns where the answer-conditioned teacher gives the turn higher "
                "likelihood than the student (s > 0). The paper's credit is informative when this "
                "moves with correctness; stuck at 0 or 1 means the teacher prompt dominates.",
                [
                    ("pbsd_trainer_teacher_higher_fraction", "last batch"),
                    ("pbsd_scorer_teacher_higher_fraction", "last group ({{instance}})"),
                ],
                unit="percentunit",
                min_=0,
                max_=1,
            ),
            panel(
                "Mean absolute teacher-student gap",
                "Mean |s| over scored turns: the size of the evidence. Near zero: weights stay at 1 "
                "and PBSD is plain GRPO.",
                [
                    ("pbsd_trainer_mean_abs_gap", "last batch"),
                    ("pbsd_scorer_mean_abs_gap", "last group ({{instance}})"),
                ],
            ),
            panel(
                "Deadband-filtered fraction",
                "Fraction of scored turns with |s| inside the deadband (weight exactly 1). Near 1: "
                "the deadband is too wide for this model's evidence scale.",
                [
                    ("pbsd_trainer_filtered_fraction", "last batch"),
                    ("pbsd_scorer_filtered_fraction", "last group ({{instance}})"),
                ],
                unit="percentunit",
                min_=0,
                max_=1,
            ),
            panel(
                "Turns by outcome",
                "Assistant turns per second: modulated (weight != 1), filtered (deadband) and "
                "unscored (no teacher position, or a GRPO run).",
                [("sum(rate(pbsd_scorer_turns_total[5m])) by (outcome)", "{{outcome}}")],
                unit="ops",
            ),
            panel(
                "Evidence histogram",
                "Distribution of per-turn evidence s over the time range; the deadband sits around 0.",
                [("sum(increase(pbsd_scorer_evidence_bucket[$__range])) by (le)", "{{le}}")],
                kind="bargauge",
                fmt="heatmap",
            ),
            panel(
                "Turn weight distribution",
                "Distribution of the per-turn weights w (1 +/- clip); mass at exactly 1 is the deadband.",
                [("sum(increase(pbsd_scorer_turn_weight_bucket[$__range])) by (le)", "{{le}}")],
                kind="bargauge",
                fmt="heatmap",
            ),
            row("Does the teacher read x*? (docs/credit-signal.md)"),
            panel(
                "Final answers the teacher judges right",
                "Of the correct final answers (reward > 0), the fraction with s > eps+; of the wrong ones "
                "(the agent's own final message, reward 0), the fraction with s < -eps-. A teacher that "
                "reads the verified answer in x* puts both near 1; near 0 it rescales advantages without "
                "telling right from wrong. Last batch (trainer) and over 10 minutes (scorer).",
                [
                    ("pbsd_trainer_correct_final_favoured_fraction", "correct, s > eps+ (last batch)"),
                    ("pbsd_trainer_wrong_final_disfavoured_fraction", "wrong, s < -eps- (last batch)"),
                    (_band("correct_final", "above"), "correct, s > eps+ (10m)"),
                    (_band("wrong_final", "below"), "wrong, s < -eps- (10m)"),
                ],
                unit="percentunit",
                min_=0,
                max_=1,
            ),
            panel(
                "Evidence on answer-free turns",
                "Mean s over scored turns that are not a final answer and do not contain the answer. "
                "An uninformative turn should sit inside the deadband [-eps-, eps+]; a clearly negative "
                "mean is x* lowering every turn, a global pessimistic rescaling rather than credit.",
                [
                    ("pbsd_trainer_answer_free_evidence_mean", "last batch"),
                    (_sanity_mean("answer_free"), "10m"),
                ],
            ),
            panel(
                "Evidence by action",
                "Mean s of searches, page reads and boxed answers, grounded (taken from what the agent "
                "read) or made up. The teacher should favour grounded actions over made-up ones.",
                [
                    ("pbsd_trainer_action_evidence_mean", "{{action}} grounded={{grounded}} (last batch)"),
                ],
            ),
            panel(
                "Evidence noise floor",
                "The scorer's null pass: student tokens scored again in the teacher pass's layout, where "
                "the true evidence is 0. Per-token std of the difference (nats), the fraction of null "
                "turns outside the deadband, and the fraction of real scored turns whose |s| lies within "
                "the floor |mu| + 2 sigma / sqrt(tokens).",
                [
                    ("pbsd_trainer_noise_floor_std", "per-token std (last batch)"),
                    (
                        "sqrt(sum(rate(pbsd_scorer_noise_squared_difference_total[10m])) / "
                        "sum(rate(pbsd_scorer_noise_tokens_total[10m])))",
                        "per-token rms (10m)",
                    ),
                    ("pbsd_trainer_noise_outside_deadband_fraction", "null turns outside the deadband"),
                    ("pbsd_trainer_within_noise_floor_fraction", "scored turns within the floor"),
                ],
            ),
            panel(
                "Scoring cost",
                "Scoring time per group (p50, p95) and loss tokens with no teacher position "
                "(the privileged context cut at teacher_max_length).",
                [
                    (_quantile(0.5, "pbsd_scorer_group_seconds"), "p50 s/group"),
                    (_quantile(0.95, "pbsd_scorer_group_seconds"), "p95 s/group"),
                    ("sum(rate(pbsd_scorer_unaligned_tokens_total[5m]))", "unaligned tokens/s"),
                ],
            ),
            panel(
                "Groups scored and passed through",
                "scored: PBSD groups with student and teacher passes; passthrough: GRPO groups.",
                [("sum(rate(pbsd_scorer_groups_total[5m])) by (kind)", "{{kind}}")],
                unit="ops",
            ),
        ],
    )


def tools() -> dict:
    ratio = "sum(rate({m}{{{sel}}}[5m])) by (tool) / sum(rate({m}[5m])) by (tool)"
    return dashboard(
        "pbsd-tools",
        "pbsd tools",
        "The tool gateway: google_search (Serper or the offline index) and "
        "scrape_and_extract_info (Jina or the offline pages, with summarisation).",
        [
            panel(
                "Calls per second",
                "Tool calls answered, by tool and outcome.",
                [("sum(rate(pbsd_tools_calls_total[1m])) by (tool, outcome)", "{{tool}} {{outcome}}")],
                unit="ops",
            ),
            panel(
                "Latency",
                "Call latency, cache hits included: median and p95 per tool.",
                [
                    (_quantile(0.5, "pbsd_tools_call_seconds", by="tool"), "p50 {{tool}}"),
                    (_quantile(0.95, "pbsd_tools_call_seconds", by="tool"), "p95 {{tool}}"),
                ],
                unit="s",
            ),
            panel(
                "Error ratio",
                "Fraction of calls that failed (the agent sees the error text and may retry).",
                [(ratio.format(m="pbsd_tools_calls_total", sel='outcome="error"'), "{{tool}}")],
                unit="percentunit",
                min_=0,
                max_=1,
            ),
            panel(
                "Cache hit ratio",
                "Fraction of lookups answered from the shared cache; identical in-flight calls are "
                "merged as well.",
                [
                    (ratio.format(m="pbsd_tools_cache_total", sel='result="hit"'), "hit ratio {{tool}}"),
                    ("sum(rate(pbsd_tools_merged_total[5m])) by (tool)", "merged/s {{tool}}"),
                ],
            ),
            panel(
                "Upstream answers and retries",
                "Requests to Serper, Jina and the summariser by HTTP status, and retries by reason "
                "(429, 5xx, timeouts).",
                [
                    (
                        "sum(rate(pbsd_tools_upstream_requests_total[5m])) by (upstream, status)",
                        "{{upstream}} {{status}}",
                    ),
                    (
                        "sum(rate(pbsd_tools_upstream_retries_total[5m])) by (upstream, reason)",
                        "retry {{upstream}} {{reason}}",
                    ),
                ],
                unit="ops",
            ),
            panel(
                "Circuit breakers",
                "Per upstream: 0 closed (healthy), 1 half-open (probing), 2 open (failing fast).",
                [("pbsd_tools_breaker_state", "{{upstream}}")],
                min_=0,
                max_=2,
                thresholds=[("green", None), ("orange", 1), ("red", 2)],
            ),
            panel(
                "Refusals",
                "Page reads refused by the SSRF guard or for a content encoding the reader does not "
                "decode, and calls refused by a trajectory's call budget.",
                [
                    ("sum(rate(pbsd_tools_ssrf_blocked_total[5m]))", "SSRF blocked"),
                    ("sum(rate(pbsd_tools_encoding_refused_total[5m]))", "encoding refused"),
                    ("sum(rate(pbsd_tools_budget_exhausted_total[5m]))", "budget exhausted"),
                ],
                unit="ops",
            ),
            panel(
                "Tool calls as the agent sees them",
                "Calls the rollout workers made, by outcome (malformed calls count as errors here).",
                [("sum(rate(pbsd_rollout_tool_calls_total[5m])) by (outcome)", "{{outcome}}")],
                unit="ops",
            ),
        ],
    )


def sglang() -> dict:
    return dashboard(
        "pbsd-sglang",
        "pbsd SGLang",
        "The SGLang server's own series (launched with --enable-metrics).",
        [
            panel(
                "Requests running and queued",
                "Running requests and the waiting queue; a long queue with full KV usage means the "
                "server is the rollout bottleneck.",
                [("sglang:num_running_reqs", "running"), ("sglang:num_queue_reqs", "queued")],
            ),
            panel(
                "KV cache usage",
                "Fraction of the KV cache in use.",
                [("sglang:token_usage", "token usage")],
                unit="percentunit",
                min_=0,
                max_=1,
            ),
            panel(
                "Throughput",
                "Generated and prefilled tokens per second.",
                [
                    ("sum(rate(sglang:generation_tokens_total[1m]))", "generated"),
                    ("sum(rate(sglang:prompt_tokens_total[1m]))", "prefilled"),
                    ("sglang:gen_throughput", "reported gen throughput"),
                ],
            ),
            panel(
                "Prefix cache hit rate",
                "Multi-turn agents resend their whole context each turn: most prompt tokens should "
                "come from the radix cache.",
                [
                    (
                        "sum(rate(sglang:cached_tokens_total[5m])) / sum(rate(sglang:prompt_tokens_total[5m]))",
                        "cached / prompt",
                    ),
                    ("sglang:cache_hit_rate", "reported"),
                ],
                unit="percentunit",
                min_=0,
                max_=1,
            ),
            panel(
                "Time to first token",
                "p50 and p95.",
                [
                    (_quantile(0.5, "sglang:time_to_first_token_seconds"), "p50"),
                    (_quantile(0.95, "sglang:time_to_first_token_seconds"), "p95"),
                ],
                unit="s",
            ),
            panel(
                "Inter-token latency",
                "p50 and p95.",
                [
                    (_quantile(0.5, "sglang:inter_token_latency_seconds"), "p50"),
                    (_quantile(0.95, "sglang:inter_token_latency_seconds"), "p95"),
                ],
                unit="s",
            ),
            panel(
                "End-to-end request latency",
                "One generation call (one assistant turn): p50 and p95.",
                [
                    (_quantile(0.5, "sglang:e2e_request_latency_seconds"), "p50"),
                    (_quantile(0.95, "sglang:e2e_request_latency_seconds"), "p95"),
                ],
                unit="s",
            ),
            panel(
                "Requests and aborts",
                "Requests finished and aborted per second.",
                [
                    ("sum(rate(sglang:num_requests_total[1m]))", "requests"),
                    ("sum(rate(sglang:num_aborted_requests_total[1m]))", "aborted"),
                ],
                unit="ops",
            ),
        ],
    )


DASHBOARDS = {"pipeline": pipeline, "credit": credit, "tools": tools, "sglang": sglang}


def render() -> dict[str, str]:
    return {f"{name}.json": json.dumps(build(), indent=2) + "\n" for name, build in DASHBOARDS.items()}


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
