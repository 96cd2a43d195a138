"""The credit dashboard: is PBSD's per-turn credit healthy (the scorer's evidence, its bands and
the teacher's sanity figures), and is the agent learning (``deploy/grafana/dashboards.py``
renders it with the others)."""

from __future__ import annotations

from dashboard_panels import dashboard, panel, quantile, row


def band(kind: str, band: str, window: str = "10m") -> str:
    """The fraction of the scorer's turns of ``kind`` in ``band`` over the window (all replicas)."""
    turns = "pbsd_scorer_sanity_turns_total"
    return f'sum(rate({turns}{{kind="{kind}",band="{band}"}}[{window}])) / sum(rate({turns}{{kind="{kind}"}}[{window}]))'


def sanity_mean(kind: str, window: str = "10m") -> str:
    """The scorer's mean s of turns of ``kind`` over the window: (positive - negative sums) / turns."""
    evidence = "pbsd_scorer_sanity_evidence_total"
    return (
        f'(sum(rate({evidence}{{kind="{kind}",sign="positive"}}[{window}])) - '
        f'sum(rate({evidence}{{kind="{kind}",sign="negative"}}[{window}]))) / '
        f'sum(rate(pbsd_scorer_sanity_turns_total{{kind="{kind}"}}[{window}]))'
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
                "gradient norm before clipping, the mean per-token KL to the initial policy "
                "(runs with kl_coef > 0; the paper uses none), and the updates skipped in the last "
                "15 minutes because the gradient was not finite (any at all is worth a look).",
                [
                    ("pbsd_trainer_loss", "loss"),
                    ("pbsd_trainer_clip_fraction", "clip fraction"),
                    ("pbsd_trainer_grad_norm", "grad norm"),
                    ("pbsd_trainer_kl_ref", "KL to reference"),
                    ("increase(pbsd_trainer_skipped_updates_total[15m])", "updates skipped (15 min)"),
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
                "(the agent's own final message boxing an answer, reward 0; a last message that boxes "
                "nothing is counted apart), the fraction with s < -eps-. A teacher that "
                "reads the verified answer in x* puts both near 1; near 0 it rescales advantages without "
                "telling right from wrong. Last batch (trainer) and over 10 minutes (scorer). The room line is "
                "the fraction of correct answers any teacher could favour at all (the student's mean "
                "log-prob over the turn below -eps+): the favoured fraction cannot exceed it.",
                [
                    ("pbsd_trainer_correct_final_favoured_fraction", "correct, s > eps+ (last batch)"),
                    ("pbsd_trainer_correct_final_room_fraction", "correct, room above eps+ (last batch)"),
                    ("pbsd_trainer_wrong_final_disfavoured_fraction", "wrong, s < -eps- (last batch)"),
                    (band("correct_final", "above"), "correct, s > eps+ (10m)"),
                    (band("wrong_final", "below"), "wrong, s < -eps- (10m)"),
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
                    (sanity_mean("answer_free"), "10m"),
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
                    (quantile(0.5, "pbsd_scorer_group_seconds"), "p50 s/group"),
                    (quantile(0.95, "pbsd_scorer_group_seconds"), "p95 s/group"),
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
