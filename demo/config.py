"""The demo's settings: everything ``pbsd demo`` does is sized here (defaults: 5 to 15 minutes on 2 cores)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# the run spec's own ranges: a setting the demo takes is one its runs' specs take
from proto.runs import Count, PbsdSpec, PositiveFloat, PositiveInt, Probability, UnitFloat

if TYPE_CHECKING:
    from services.trainer.note_pass import NotePassConfig
    from services.trainer.sft import SftConfig

__all__ = ["ASSETS", "DemoConfig"]

# The warmed-up tiny policy committed with the repository (see assets/demo-policy/RECIPE.md).
ASSETS = Path(__file__).resolve().parent.parent / "assets" / "demo-policy"


Difficulty = Literal["easy", "medium", "hard"]
WARM_START = (
    "vocab_size",
    "hidden_size",
    "entity_tokens",
    "copy_heads",
    "kv_heads",
    "sft_epochs",
    "sft_lr",
    "sft_batch_size",
    "sft_warmup_steps",
    "sft_search_num",
    "sft_rename",
    "sft_final",
    "boxed_pass_conversations",
    "boxed_pass_lr",
    "boxed_pass_epochs",
    "boxed_pass_warmup_steps",
    "teacher_sft_formats",
    "teacher_sft_conversations",
    "teacher_sft_lr",
    "teacher_sft_epochs",
    "teacher_sft_warmup_steps",
    "teacher_sft_contradict",
    "note_pass_steps",
    "note_pass_lr",
    "note_pass_conversations",
    "note_pass_hops",
    "note_pass_consistency",
    "note_pass_doubt",
    "note_pass_same_final",
)


class DemoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seed: Count = 0
    algorithm: Literal["pbsd", "grpo", "both"] = "pbsd"
    # the world
    entities: PositiveInt = 2000
    n_rl: Count = 575
    n_val: Count = 200
    # 6000 oracle trajectories: with fewer the tiny policy memorises instead of learning to copy
    # names from the question into its searches (1000 x 8 epochs: 0/24 on validation)
    n_sft: Count = 6000
    difficulty: list[Difficulty] = Field(
        default=["easy"], description="difficulties of the RL questions the tiny policy trains on"
    )
    eval_split: Literal["rl", "validation"] = Field(
        default="rl",
        description="where the questions evaluated before and after come from: set aside from the RL "
        "questions (their difficulties, never trained on; see demo/questions.py) or the validation split",
    )
    eval_difficulty: list[Difficulty] = Field(
        # validation takes the rarest answers, so with 6000 SFT questions it holds only 7 easy ones
        default=["easy", "medium"],
        description="with eval_split validation: the difficulties evaluated",
    )
    # the warm start (used with --from-scratch, or when the committed policy does not fit the world
    # or these settings: see warm_start)
    from_scratch: bool = False
    policy: str | None = Field(
        default=None, description="start from this checkpoint instead (must fit the world)"
    )
    vocab_size: PositiveInt = 4096
    hidden_size: PositiveInt = 128
    sft_epochs: PositiveInt = 2
    sft_lr: PositiveFloat = 2e-3
    sft_batch_size: PositiveInt = 16
    sft_warmup_steps: Count = 10
    sft_search_num: PositiveInt = 3  # results per search in the oracle trajectories (shorter contexts)
    sft_rename: UnitFloat = 0.0  # fraction of trajectories renamed (worldgen/rename.py); 0: as committed
    # how the oracle's last turn writes the answer (`pbsd world sft-data --final`): "restate" names it
    # in a sentence and then boxes it, "boxed" makes the box its first mention
    sft_final: Literal["restate", "boxed"] = "restate"
    # a short SFT pass after the first on the oracle data with the box as the answer's first mention
    # (`pbsd world sft-data --final boxed`; `pbsd sft --limit N`), which the note pass then learns from.
    # A policy trained on the restate data has learnt to copy the answer into the box from its
    # context, and the note pass points that at x*; one trained on the boxed data from the start has
    # not, and the same note pass does not teach it to read x* (assets/demo-policy/RECIPE.md)
    boxed_pass_conversations: int = Field(
        default=1600, ge=0, description="the first N boxed SFT conversations; 0: no boxed pass"
    )
    boxed_pass_lr: PositiveFloat = 1e-3
    boxed_pass_epochs: PositiveInt = 1
    boxed_pass_warmup_steps: Count = 5
    entity_tokens: bool = True  # one token per entity name and address (`pbsd model tiny --entity-tokens`)
    copy_heads: bool = True  # hand-built heads that copy entity tokens (`pbsd model tiny --copy-heads`)
    kv_heads: int = Field(default=4, ge=1, le=4, description="key-value groups of the 4 attention heads")
    # a second SFT pass from the first that also learns conversations after x* (`pbsd sft
    # --teacher-format`, --teacher-contradict), for a teacher that reads the note it is given. Off
    # by default: on the demo's policy it brought the answer-free evidence into the deadband's
    # neighbourhood but neither favoured correct answers nor cost nothing in accuracy
    # (docs/credit-signal.md, "Teaching the tiny teacher to read x*"); e.g. ["answer:0.5",
    # "support:0.5"] turns it on
    teacher_sft_formats: list[str] = Field(
        default=[], description="NAME:FRACTION, as pbsd sft --teacher-format; empty: no second pass"
    )
    teacher_sft_conversations: int = Field(default=800, ge=1, description="the first N SFT conversations")
    teacher_sft_lr: PositiveFloat = 1e-3
    teacher_sft_epochs: PositiveInt = 1
    teacher_sft_warmup_steps: Count = 5
    teacher_sft_contradict: UnitFloat = 0.5  # pbsd sft --teacher-contradict
    # a note pass after SFT (`pbsd teacher teach`, services/trainer/note_pass.py): learns the answer
    # of cut conversations after x* (half with tool results naming a decoy) beside whole ones, and
    # with note_pass_consistency holds the answer-free tokens after x* to the student's. It teaches
    # teacher_template's x*, so the committed policy fits only the default teacher. On the restate
    # data it moved answer-free turns out of the deadband (docs/credit-signal.md, "The note pass");
    # after the boxed pass, with L_same, they stay in it (t23 there; the committed policy: RECIPE.md)
    note_pass_steps: int = Field(default=400, ge=0, description="steps of the note pass; 0: no note pass")
    note_pass_lr: PositiveFloat = 2e-4
    note_pass_conversations: int = Field(default=3000, ge=1, description="the first N SFT conversations")
    note_pass_hops: float = Field(default=0.0, ge=0, description="L_hop's weight (pbsd teacher teach --hops)")
    note_pass_consistency: float = Field(
        default=1.0, ge=0, description="L_same's weight (pbsd teacher teach --consistency)"
    )
    note_pass_doubt: float = Field(
        default=0.0, ge=0, le=1, description="the student's doubt on its answers (pbsd teacher teach --doubt)"
    )
    note_pass_same_final: bool = Field(
        default=False, description="L_same holds the final turn's phrasing too (--same-final)"
    )
    # PBSD's teacher: x*'s template, a name of proto.templates.TEACHER_TEMPLATES or a template of one's
    # own. "answer-first" is the paper's answer-only teacher with a short note before the question:
    # on the SFT policy before any note pass the long note after the question lowers every later turn
    # (answer-free mean s -0.021, seven times eps-), the short one leaves them in the deadband
    # (-0.0025) (docs/credit-signal.md, "Where the note goes"); the note pass teaches this template
    teacher_template: str = "answer-first"
    # RL
    steps: PositiveInt = 16
    prompts_per_step: PositiveInt = 4
    # optimiser updates a step, each on a mini-batch of whole groups (trainer.updates_per_step;
    # docs/algorithm.md, "batch size"): 1 is one update on the step's 32 trajectories
    updates_per_step: PositiveInt = 1
    group_size: PositiveInt = 8
    max_turns: PositiveInt = 12
    max_tokens_per_turn: PositiveInt = 160
    max_context: PositiveInt = 6144
    lr: PositiveFloat = 1e-4
    warmup_steps: Count = 2
    max_staleness: Count = 1
    rollout_concurrency: PositiveInt = 4
    # Intra-op threads of every torch process (the rollout, scorer and trainer services, and the
    # evaluations in this process). The three services run at once on the 2 cores the demo is
    # sized for: with 2 OpenMP threads each, a parallel op waits at its barrier for a thread the
    # scheduler has set aside, and the tiny model's ops are too small to gain from a second one.
    torch_threads: int = Field(default=1, ge=1)
    # a run with no new training step for this long is stopped as stalled (a step takes 15-25 s here)
    stall_timeout_s: float = Field(default=600.0, gt=0)
    # evaluation before and after
    # 48 questions, the same sampling seeds before and after: under a minute each time here; one
    # sample each keeps the demo short (pbsd compare measures with 200 questions and several seeds)
    eval_questions: PositiveInt = 48
    eval_samples: PositiveInt = 1
    eval_top_p: Probability = 0.95
    # trajectories evaluated at once: the in-process engine decodes them in one batch, and a
    # trajectory's tokens do not depend on what shares its batch, so this changes time, not answers
    eval_concurrency: int = Field(default=16, ge=1)

    @classmethod
    def load(cls, path: Path | None = None, **overrides: object) -> DemoConfig:
        """The settings of a YAML or JSON file (``--config``; none: the defaults), then those of
        ``overrides`` that are not None (command-line options)."""
        import yaml

        return cls.merged((yaml.safe_load(path.read_text()) or {}) if path is not None else {}, **overrides)

    @classmethod
    def merged(cls, values: dict, *, defaults: dict | None = None, **overrides: object) -> DemoConfig:
        """``values`` (a file's settings) over ``defaults`` (a command's own) over the class's, and
        under the ``overrides`` that are not None (command-line options)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        return cls(**{**(defaults or {}), **values, **given})

    def settings_used(self) -> dict[str, object]:
        """The settings that take effect, as ``demo-config.json`` records them (``--config`` loads
        the file again): ``eval_difficulty`` only where the validation split is evaluated, since
        questions set aside from the RL split have the RL difficulties (``difficulty``)."""
        unused = {"eval_difficulty"} if self.eval_split == "rl" else set()
        return self.model_dump(mode="json", exclude=unused)

    @field_validator("teacher_template")
    @classmethod
    def _known_template(cls, value: str) -> str:
        PbsdSpec(teacher_template=value)  # refused here, before a world is built
        return value

    def teacher(self) -> str:
        """The teacher template itself (``teacher_template`` names one, or is one)."""
        return PbsdSpec(teacher_template=self.teacher_template).teacher_template

    def warm_start(self) -> dict[str, object]:
        """The settings that shape the warm policy beyond the world itself (the world has its own
        fingerprint): the committed policy stands in for a rebuild only where all of them are the
        defaults it was made with (tests/test_policy_recipe.py ties those to the asset)."""
        # a note pass teaches the runs' own x*, so with one the template shapes the policy too
        return {k: getattr(self, k) for k in WARM_START} | {
            "note_pass_template": self.teacher() if self.note_pass_steps else None
        }

    def sft_config(self, **stage: object) -> SftConfig:
        """The warm start's SFT settings; ``stage`` overrides them for a pass after it, which shares
        the batch size and the seed (SftConfig is imported here, not at the top: its module loads
        torch)."""
        from services.trainer.sft import SftConfig

        first = {
            "epochs": self.sft_epochs,
            "lr": self.sft_lr,
            "batch_size": self.sft_batch_size,
            "warmup_steps": self.sft_warmup_steps,
            "seed": self.seed,
        }
        return SftConfig(**(first | stage))

    def note_pass_config(self) -> NotePassConfig | None:
        """The note pass, from the SFT's result; None when there is none."""
        from services.trainer.note_pass import NotePassConfig

        if not self.note_pass_steps:
            return None
        return NotePassConfig(
            template=self.teacher_template,
            steps=self.note_pass_steps,
            lr=self.note_pass_lr,
            limit=self.note_pass_conversations,
            hops=self.note_pass_hops,
            consistency=self.note_pass_consistency,
            doubt=self.note_pass_doubt,
            same_final=self.note_pass_same_final,
            seed=self.seed,
        )

    def teacher_sft_config(self) -> SftConfig | None:
        """The teacher's SFT pass, from the pass before it; None when there is none."""
        from services.trainer.teacher_sft import parse_teacher_formats

        if not self.teacher_sft_formats:
            return None
        return self.sft_config(
            epochs=self.teacher_sft_epochs,
            lr=self.teacher_sft_lr,
            warmup_steps=self.teacher_sft_warmup_steps,
            teacher_formats=parse_teacher_formats(self.teacher_sft_formats),
            teacher_contradict=self.teacher_sft_contradict,
            limit=self.teacher_sft_conversations,
        )

    def boxed_pass_config(self) -> SftConfig | None:
        """The boxed SFT pass, from the first pass's result; None when there is none."""
        if not self.boxed_pass_conversations:
            return None
        return self.sft_config(
            epochs=self.boxed_pass_epochs,
            lr=self.boxed_pass_lr,
            warmup_steps=self.boxed_pass_warmup_steps,
            limit=self.boxed_pass_conversations,
        )
