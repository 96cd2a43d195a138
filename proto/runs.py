"""The run specification: what a user submits with ``POST /runs`` (or ``pbsd runs submit``).

Defaults are the paper's (section 4.1): G = 8 samples a prompt at temperature 1.0
and top-p 1.0, up to 300 turns of at most 16,384 new tokens in a 64K context,
32 prompts a step, Adam with lr 3e-6, 8 warm-up steps and weight decay 0.1,
clipping 0.2 / 0.28, and PBSD with delta 0.1, c 0.1, eps+ 0.001, eps- 0.003.
"""

from __future__ import annotations

import re
import string
from typing import Annotated, Any, Literal, get_args

from pydantic import BeforeValidator, ConfigDict, Field, field_validator, model_validator

from pbsd import credit
from proto.base import Contract, Message, unfit_value
from proto.templates import (
    DEFAULT_TEACHER_TEMPLATE,
    TEACHER_TEMPLATES,
    TEMPLATE_FIELDS,
    template_fields,
)

__all__ = [
    "AlgorithmSpec",
    "Count",
    "DataSpec",
    "GrpoSpec",
    "LrDecay",
    "ModelSpec",
    "PbsdSpec",
    "PositiveFloat",
    "PositiveInt",
    "Probability",
    "RolloutSpec",
    "RunSpec",
    "Seed",
    "TrainerSpec",
    "UnitFloat",
]

# Counts stay below 2^53: past 2^64 a spec is accepted and then cannot be sent on the bus (msgpack's
# integers end there), and below 2^53 a count survives any JSON reader exactly.
MAX_COUNT = 2**53
PositiveInt = Annotated[int, Field(gt=0, lt=MAX_COUNT)]
Count = Annotated[int, Field(ge=0, lt=MAX_COUNT)]
PositiveFloat = Annotated[float, Field(gt=0)]
UnitFloat = Annotated[float, Field(ge=0, le=1)]
Probability = Annotated[float, Field(gt=0, le=1)]  # a top-p
Beta = Annotated[float, Field(ge=0, lt=1)]  # AdamW's moment decays: 1 never forgets, and torch refuses it
# What every consumer of a seed takes, refused at submission rather than at the run's start: numpy
# refuses negative seeds, and the rollout seeds each turn with (seed + sample + 1000 * prompt) * 1000
# + turn, which torch.manual_seed takes only below 2^64.
Seed = Annotated[int, Field(ge=0, lt=2**53)]
_PRECISION = re.compile(r"\.\d{1,4}")  # "{answer:.0}": a template field's one allowed format spec
LrDecay = Literal["constant", "cosine"]  # after warm-up (also pbsd sft's --lr-decay)


def _leaf_types(annotation: Any) -> set[Any]:
    args = get_args(annotation)
    return set().union(*map(_leaf_types, args)) if args else {annotation}


class _Spec(Contract):
    """A part of the run specification: numbers are finite (NaN and infinities are refused), and a
    number is a number: pydantic would read ``true`` as 1, so ``group_size: true`` sampled one."""

    model_config = ConfigDict(allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_number(cls, data: Any) -> Any:
        for name, value in data.items() if isinstance(data, dict) else ():
            field = cls.model_fields.get(name)
            items = value if isinstance(value, list | tuple) else (value,)  # betas: [false, 0.9]
            flagged = field is not None and any(isinstance(v, bool) for v in items)
            kinds = _leaf_types(field.annotation) if flagged else set()
            if kinds & {int, float} and not kinds & {bool, Any}:
                raise ValueError(f"{name}: {value!r} holds a boolean, not a number")
        return data


# A file or directory on the trainer: no longer than Linux's PATH_MAX, and without the NUL byte no
# file system takes (refused here as a 422, not as a 500 where the trainer opens it).
TrainerPath = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00]+$")]
# An optional one: "" reads as none, as the trainer has always taken it (and stored it).
OptionalTrainerPath = Annotated[TrainerPath | None, BeforeValidator(lambda v: None if v == "" else v)]


class ModelSpec(_Spec):
    path: TrainerPath = Field(
        description="Hugging Face checkpoint directory (or hub id where the hub is reachable)"
    )
    tokenizer: OptionalTrainerPath = Field(
        default=None,
        description="the trainer's tokenizer directory (defaults to the model path); rollout workers and "
        "scorers tokenize with the checkpoint they serve (PBSD_ROLLOUT_MODEL, PBSD_SCORER_MODEL)",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="bfloat16",
        description="the trainer's dtype on a GPU (a CPU trainer computes in float32); rollout and "
        "scorer use their own PBSD_*_DTYPE",
    )


class DataSpec(_Spec):
    train: TrainerPath = Field(description="question file (JSONL or Parquet) for RL")
    validation: OptionalTrainerPath = Field(
        default=None,
        description="held-out question file: the rollout workers evaluate the policy on it before the "
        "first step, every trainer.eval_every steps and after the last (mean@k and pass@k in evals.jsonl)",
    )
    max_validation_questions: PositiveInt | None = Field(
        default=None, description="evaluate only the first N validation questions"
    )
    epochs: PositiveInt = 1
    shuffle_seed: Seed = 0
    max_questions: PositiveInt | None = Field(
        default=None, description="use only the first N questions after shuffling"
    )


# The upper bounds below are far past any real run (the paper: G = 8, 300 turns, 16K tokens a turn,
# 64K context, on-policy): they keep one spec from asking a worker for 10**9 concurrent samples or
# the controller for 10**9 prompts at once, which are accepted and then exhaust memory.
class RolloutSpec(_Spec):
    group_size: Annotated[int, Field(gt=0, le=1024)] = Field(
        default=8, description="G, trajectories sampled per prompt"
    )
    temperature: Annotated[float, Field(ge=1e-5)] = Field(
        default=1.0,
        description="sampling temperature; the trainer's log-probs are of softmax(logits / T) to match the "
        "engine's, and the scorer's evidence stays the model's own likelihood (T = 1). At least 1e-5: "
        "below 1e-6 SGLang samples greedily and reports log-probs at T = 1, which no T would match",
    )
    top_p: Probability = 1.0
    eval_top_p: Probability = Field(
        default=0.95, description="top-p of validation samples (the paper evaluates with 0.95)"
    )
    eval_samples: Annotated[int, Field(gt=0, le=1024)] = Field(
        default=4, description="samples per validation question: k of mean@k (the paper reports mean@4)"
    )
    max_turns: Annotated[int, Field(gt=0, le=100_000)] = 300
    max_tokens_per_turn: Annotated[int, Field(gt=0, le=2**20)] = 16_384
    max_context: Annotated[int, Field(gt=0, le=2**24)] = 65_536
    max_calls_per_turn: Annotated[int, Field(gt=0, le=1024)] = Field(
        default=8,
        description="tool calls one assistant message may make; all run in order (as MiroFlow runs them), "
        "those past this fail unrun and say so",
    )
    max_staleness: Annotated[int, Field(ge=0, le=64)] = Field(
        default=1,
        description="how many policy versions rollouts may run ahead of the trainer (0 = strictly on-policy)",
    )
    return_routed_experts: bool = Field(
        default=False, description="record MoE routes for routing replay (R3)"
    )


class _PolicyGradientSpec(_Spec):
    eps_low: Annotated[float, Field(ge=0, lt=1)] = 0.2
    eps_high: Annotated[float, Field(ge=0)] = 0.28
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "constant"] = (
        "seq-mean-token-mean"
    )
    loss_agg_constant: PositiveFloat | None = None
    kl_coef: Annotated[float, Field(ge=0)] = Field(
        default=0.0,
        description="beta of a KL penalty to the run's initial policy (the paper uses none); > 0 "
        "loads that policy beside the trainer's and trains zero-advantage trajectories on it",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        default="k3", description="Schulman's estimator of KL(pi_theta || pi_ref) per token"
    )
    tis_cap: PositiveFloat | None = Field(
        default=None, description="truncated importance-sampling cap C (off when None)"
    )

    @model_validator(mode="after")
    def _constant_needs_value(self):
        if self.loss_agg == "constant" and self.loss_agg_constant is None:
            raise ValueError("loss_agg 'constant' needs loss_agg_constant")
        return self


class GrpoSpec(_PolicyGradientSpec):
    """Plain GRPO: every token of trajectory i gets A_i."""

    name: Literal["grpo"] = "grpo"


class PbsdSpec(_PolicyGradientSpec):
    """GRPO with PBSD's evidence-calibrated turn weights."""

    name: Literal["pbsd"] = "pbsd"
    delta: PositiveFloat = credit.DEFAULT_DELTA
    clip: Annotated[float, Field(ge=0, le=1)] = credit.DEFAULT_CLIP
    eps_pos: Annotated[float, Field(ge=0)] = credit.DEFAULT_EPS_POS
    eps_neg: Annotated[float, Field(ge=0)] = credit.DEFAULT_EPS_NEG
    reduce: Literal["mean", "sum"] = Field(
        default="mean", description="turn evidence: Algorithm 1's mean or section 3's sum"
    )
    teacher_template: str = Field(
        default=DEFAULT_TEACHER_TEMPLATE,
        min_length=1,
        description="x*'s template, or the name of one of TEACHER_TEMPLATES (answer, answer-first, support, support-first)",
    )
    teacher_max_length: Annotated[int, Field(gt=0, le=2**24)] | None = Field(
        default=None,
        description="tokens beyond this in x* have no phi and are left out; None: no cut, so every loss "
        "token has a teacher position, as the paper's s_{i,t} assumes. x* is longer than x by the note, "
        "so a cut at rollout.max_context drops the end of every trajectory that fills its context; set "
        "it where the scorer's own context is shorter (an SGLang scorer's --context-length)",
    )
    noise_floor_samples: Annotated[int, Field(ge=0, le=1024)] = Field(
        default=1,
        description="trajectories per group whose student context the scorer scores a second time in "
        "the teacher pass's layout (the null pass, whose true evidence is 0): the evidence's numerical "
        "noise floor, at about 1/(2G) more scoring work each; 0 turns it off",
    )
    evidence_routing: Literal["fresh", "replay"] = Field(
        default="fresh",
        description="MoE routing of both evidence passes: fresh (the paper) or replay, the rollout's "
        "recorded routes forced (Table 1's ablation 'w/o non-replay recompute'; needs "
        "rollout.return_routed_experts and the scorer's local backend; see services/scorer/replay.py)",
    )

    @property
    def deadband(self) -> bool:
        """Whether the weights have a deadband at all (the ablation 'no deadband' has none): without
        one, every null turn that rounding moves lies outside it, which figures must say."""
        return bool(self.eps_pos or self.eps_neg)

    @field_validator("teacher_template", mode="before")
    @classmethod
    def _named_template(cls, value: Any) -> Any:
        # a name stands for its template: no template is a bare name, since one needs {question}
        return TEACHER_TEMPLATES.get(value, value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _template_fields(self):
        try:
            parsed = [(n, spec, conv) for _, n, spec, conv in string.Formatter().parse(self.teacher_template)]
        except ValueError as exc:
            raise ValueError(f"teacher_template is not a valid format string: {exc}") from None
        # a field is filled as written: a format spec can nest fields of its own ("{answer:{0}}") or
        # pad an answer to a gigabyte ("{answer:>999999999}"), and a conversion ("{answer!r}") changes
        # how x* shows the answer. A precision only cuts: "{answer:.0}" is the note without its answer
        # (a control: docs/credit-signal.md), and x* = x with "{question}{answer:.0}"
        if any(
            (spec and not _PRECISION.fullmatch(spec)) or conv for n, spec, conv in parsed if n is not None
        ):
            raise ValueError(
                "teacher_template's fields take no format spec but a precision (.N) and no conversion: "
                "write {question}, {answer} and {support} as they are"
            )
        fields = {n for n, _, _ in parsed if n is not None}
        if not {"question", "answer"} <= fields <= set(TEMPLATE_FIELDS):
            raise ValueError(
                "teacher_template must use the fields {question} and {answer}, and may use {support}; "
                f"found {sorted(fields)}"
            )
        return self

    @property
    def needs_support(self) -> bool:
        """Whether x* holds the question's supporting facts (every question must then have some)."""
        return "support" in template_fields(self.teacher_template)


AlgorithmSpec = Annotated[GrpoSpec | PbsdSpec, Field(discriminator="name")]


# A DeepSpeed config nests four levels or so. The store reads specs back with pydantic's JSON
# parser, which refuses about 200 levels: a deeper config would be accepted and then make its run
# unreadable (a 500 on every listing, an executor that cannot load its queue).
MAX_CONFIG_DEPTH = 32


_CONFIG_PROBLEMS = {
    "not finite": "must hold finite numbers only (no NaN or Infinity)",
    "too large": "must hold integers below 2^64",
    "too deep": f"must nest at most {MAX_CONFIG_DEPTH} levels deep",
}


class TrainerSpec(_Spec):
    prompts_per_step: Annotated[int, Field(gt=0, le=65_536)] = Field(
        default=32, description="groups per training step (one policy version)"
    )
    updates_per_step: Annotated[int, Field(gt=0, le=65_536)] = Field(
        default=1,
        description="optimiser updates a step: the step's groups are split into this many "
        "mini-batches of whole groups, each one update, as verl's ppo_mini_batch_size and slime's "
        "num_steps_per_rollout do. Every update's ratio is against the same pi_old (the rollout's "
        "log-probs, or with tis_cap the policy before the step's first update), so from the second "
        "update on the clip range binds. The learning-rate schedule counts steps (a scheduler a "
        "deepspeed_config names counts updates). At most prompts_per_step",
    )
    max_steps: PositiveInt = 100
    lr: PositiveFloat = 3e-6
    warmup_steps: Count = 8
    lr_decay: LrDecay = Field(
        default="constant",
        description="after warm-up: hold the learning rate, or cosine-decay it to "
        "min_lr_ratio * lr at max_steps",
    )
    min_lr_ratio: UnitFloat = 0.1
    weight_decay: Annotated[float, Field(ge=0)] = 0.1
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    grad_clip: PositiveFloat | None = 1.0
    master_weights: bool = Field(
        default=True,
        description="a bfloat16 or float16 policy (model.dtype on a GPU) is updated through float32 "
        "copies of its weights, as mixed-precision training does: AdamW on bfloat16 weights loses "
        "every update below 2^-9 of the weight (at lr 3e-6, nearly all of them). false saves 8 bytes "
        "a parameter and loses those updates. DeepSpeed's ZeRO keeps its own copies",
    )
    micro_batch_tokens: PositiveInt = Field(
        default=65_536, description="token budget of one forward/backward"
    )
    publish_every: PositiveInt = Field(
        default=1,
        description="publish new weights every N steps; at most rollout.max_staleness + 1, or the rollout "
        "workers would wait for a version that is never published",
    )
    checkpoint_every: PositiveInt = 10
    keep_checkpoints: Annotated[int, Field(ge=2, lt=MAX_COUNT)] | None = Field(
        default=None,
        description="keep only the newest N checkpoints (None: every one). A checkpoint holds the "
        "weights and the optimiser state, about 16 bytes a parameter with float32 copies and AdamW: "
        "about 500 GB for a 30B model. At least 2: a version published just before a checkpoint "
        "names the one before it as the copy a worker that missed the broadcast loads",
    )
    eval_every: Count = Field(
        default=0,
        description="with data.validation: also evaluate every N steps (0: only before the first "
        "step and after the last)",
    )
    seed: Seed = Field(
        default=0,
        description="seeds the trainer's RNGs at the start of a run and every sample the rollout "
        "workers draw for it (prompt tasks carry it), so a run's trajectories do not depend on "
        "which worker took which prompt (SGLang servers honour sampling seeds only when started "
        "with --enable-deterministic-inference)",
    )
    routing_replay: bool = Field(
        default=False, description="R3: force the rollout's experts in the policy forward"
    )
    deepspeed_config: TrainerPath | dict[str, Any] | None = Field(
        default=None,
        description="DeepSpeed's JSON config, inline (an object) or the path of a file on the "
        "trainer; plain torch when None. What it leaves out comes from this spec; an optimizer, "
        "scheduler or gradient_clipping it does set wins over lr, betas, weight_decay, the "
        "warm-up/decay schedule and grad_clip",
    )

    @field_validator("deepspeed_config")
    @classmethod
    def _finite_config(cls, value):
        if isinstance(value, dict) and (problem := unfit_value(value, MAX_CONFIG_DEPTH)):
            raise ValueError(f"deepspeed_config {_CONFIG_PROBLEMS[problem]}")
        return value

    @model_validator(mode="after")
    def _whole_groups(self):
        # a mini-batch is whole groups: with more updates than groups some would train on nothing
        if self.updates_per_step > self.prompts_per_step:
            raise ValueError(
                f"trainer.updates_per_step ({self.updates_per_step}) cannot exceed prompts_per_step "
                f"({self.prompts_per_step}): each update trains on whole groups"
            )
        return self


class RunSpec(Message):
    """A whole RL run. ``algorithm`` is ``{"name": "pbsd", ...}`` or ``{"name": "grpo", ...}``."""

    model_config = ConfigDict(allow_inf_nan=False)

    # no control characters: a name is logged and printed, where a newline forges a log line and an
    # escape sequence drives the reader's terminal. C1 controls (CSI, NEL) and the line separators
    # do the same for terminals and readers that honour them, and bidi embeddings, overrides and
    # isolates reorder the line (the marks LRM, RLM and ALM, which right-to-left names use, stay)
    name: str = Field(
        default="run",
        min_length=1,
        max_length=128,
        pattern=r"^[^\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]+$",
    )
    model: ModelSpec
    data: DataSpec
    rollout: RolloutSpec = RolloutSpec()
    algorithm: AlgorithmSpec = PbsdSpec()
    trainer: TrainerSpec = TrainerSpec()

    @model_validator(mode="after")
    def _consistent(self):
        if self.rollout.max_tokens_per_turn > self.rollout.max_context:
            raise ValueError("rollout.max_tokens_per_turn cannot exceed rollout.max_context")
        if self.trainer.routing_replay and not self.rollout.return_routed_experts:
            raise ValueError("trainer.routing_replay needs rollout.return_routed_experts")
        replayed = isinstance(self.algorithm, PbsdSpec) and self.algorithm.evidence_routing == "replay"
        if replayed and not self.rollout.return_routed_experts:
            raise ValueError("algorithm.evidence_routing 'replay' needs rollout.return_routed_experts")
        if self.trainer.eval_every and not self.data.validation:
            raise ValueError("trainer.eval_every needs data.validation (the questions to evaluate on)")
        if self.trainer.publish_every > self.rollout.max_staleness + 1:
            # the prompts of step s need version >= s - max_staleness, and between publications
            # the newest version out lags the trainer's by up to publish_every - 1
            raise ValueError(
                f"trainer.publish_every ({self.trainer.publish_every}) cannot exceed rollout.max_staleness + 1 "
                f"({self.rollout.max_staleness + 1}): the run would stall waiting for unpublished weights"
            )
        return self
