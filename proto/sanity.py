"""Teacher sanity figures and the evidence's noise floor, as counts that add up across groups.

The scorer fills these for every PBSD group (``ScoreDiagnostics.sanity`` and ``.noise``); the
trainer, the demo report, the credit viewer and ``pbsd teacher check`` add them up over a batch,
a run or a question set. Everything is kept as counts and sums, never as a group's mean or
fraction, so that the sum over groups gives the exact figure of their union (weighted by turns
and tokens, not a mean of group means). What the figures mean: ``docs/credit-signal.md``.

An :class:`EvidenceTally` counts a set of scored turns (s not NaN)::

    turns, sum_s, sum_abs,  higher (s > 0),  above (s > eps+),  below (s < -eps-),
    room (ceiling > eps+)

A turn's *ceiling* is the largest s its teacher could give it: the teacher's log-probs are at most
0, so s <= -(the student's mean log-prob over the turn's aligned tokens). A turn the student already
writes with near certainty (a copied answer, a formatted box) has a ceiling below eps+, and no
teacher, however well it reads x*, can favour it; ``room`` counts the turns that could be.

A :class:`NoiseFloor` summarises the null pass, in which student tokens are scored a second
time in the teacher pass's batch layout, so that each difference d_k = null_k - student_k is
numerical noise (its true value is 0)::

    per-token mean  mu = sum_d / tokens,   std  sigma = sqrt(sum_d2 / tokens - mu^2)
    null turns outside the deadband:  outside / turns   (a null turn's s = mean of its d_k)
    floor of a turn of n tokens:      |mu| + z sigma / sqrt(n)        (z = FLOOR_Z)

A turn whose |s| lies within its floor cannot be told apart from the kernels' rounding.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, get_args

import numpy as np
from pydantic import Field

from proto.base import Contract

__all__ = [
    "ACTION_CLASSES",
    "FLOOR_Z",
    "TURN_KINDS",
    "ActionClass",
    "EvidenceTally",
    "NoiseFloor",
    "TeacherSanity",
]

NonNegInt = Annotated[int, Field(ge=0)]
Finite = Annotated[float, Field(allow_inf_nan=False)]

# a null turn mean stays within |mu| + 2 sigma / sqrt(n) about 95% of the time when the per-token
# differences are independent (the H100 measurements match that model to a few points)
FLOOR_Z = 2.0

# the actions agent.grounding judges (search, page read, boxed answer), grounded or made up
ActionClass = Literal[
    "queries/grounded",
    "queries/made-up",
    "reads/grounded",
    "reads/made-up",
    "answers/grounded",
    "answers/made-up",
]
ACTION_CLASSES: tuple[str, ...] = get_args(ActionClass)
TURN_KINDS = ("answer_free", "answer_bearing", "correct_final", "wrong_final", "unboxed_final")


def _fraction(part: int, whole: int) -> float | None:
    return part / whole if whole else None


class EvidenceTally(Contract):
    """How many scored turns of one kind, the sum of their evidence, and how many lie above 0,
    above eps+ and below -eps- (the run's deadband at scoring time)."""

    turns: NonNegInt = 0
    sum_s: Finite = 0.0
    sum_abs: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    higher: NonNegInt = Field(default=0, description="turns with s > 0 (teacher > student)")
    above: NonNegInt = Field(default=0, description="turns with s > eps+ (high value)")
    below: NonNegInt = Field(default=0, description="turns with s < -eps- (low value)")
    room: NonNegInt = Field(
        default=0, description="turns whose ceiling (the largest s any teacher could give) exceeds eps+"
    )

    @classmethod
    def of(cls, evidence, *, eps_pos: float, eps_neg: float, ceilings=None) -> EvidenceTally:
        """The tally of the non-NaN entries of ``evidence``; ``ceilings`` (aligned with it, None:
        not known) gives ``room``."""
        s = np.asarray(evidence, dtype=np.float64)
        scored = ~np.isnan(s)
        room = 0
        if ceilings is not None:
            c = np.asarray(ceilings, dtype=np.float64)
            if c.shape != s.shape:
                raise ValueError(f"ceilings ({c.shape}) and evidence ({s.shape}) must align")
            room = int((c[scored] > eps_pos).sum())
        s = s[scored]
        return cls(
            turns=int(s.size),
            sum_s=float(s.sum()),
            sum_abs=float(np.abs(s).sum()),
            higher=int((s > 0).sum()),
            above=int((s > eps_pos).sum()),
            below=int((s < -eps_neg).sum()),
            room=room,
        )

    def __add__(self, other: EvidenceTally) -> EvidenceTally:
        return EvidenceTally(**{k: getattr(self, k) + getattr(other, k) for k in type(self).model_fields})

    @property
    def mean_s(self) -> float | None:
        return self.sum_s / self.turns if self.turns else None

    @property
    def higher_frac(self) -> float | None:
        return _fraction(self.higher, self.turns)

    @property
    def above_frac(self) -> float | None:
        return _fraction(self.above, self.turns)

    @property
    def below_frac(self) -> float | None:
        return _fraction(self.below, self.turns)

    @property
    def room_frac(self) -> float | None:
        return _fraction(self.room, self.turns)

    @property
    def deadband_frac(self) -> float | None:
        return _fraction(self.turns - self.above - self.below, self.turns)


class TeacherSanity(Contract):
    """The scored turns of a group by kind. Each turn is one of the five kinds of turn:

    ``correct_final``: the last turn of a trajectory with reward > 0; ``wrong_final``: the last turn
    of a trajectory that ended on its own final message (finish reason "answer") with a boxed answer
    and reward 0; ``unboxed_final``: the last turn of one that ended on its own message with nothing
    boxed (no answer to verify, so in neither final figure);
    ``answer_bearing``: any other turn whose text contains the verified answer or an alias
    (:func:`pbsd.verifier.mentions`); ``answer_free``: every other turn. A turn that searches, reads
    or answers also counts in one of ``actions``, by whether the action was grounded
    (:func:`agent.grounding.turn_verdicts`). How the scorer classifies: services/scorer/sanity.py."""

    answer_free: EvidenceTally = EvidenceTally()
    answer_bearing: EvidenceTally = EvidenceTally()
    correct_final: EvidenceTally = EvidenceTally()
    wrong_final: EvidenceTally = EvidenceTally()
    unboxed_final: EvidenceTally = EvidenceTally()
    actions: dict[ActionClass, EvidenceTally] = Field(default_factory=dict)

    def __add__(self, other: TeacherSanity) -> TeacherSanity:
        keys = [k for k in ACTION_CLASSES if k in self.actions or k in other.actions]
        return TeacherSanity(
            answer_free=self.answer_free + other.answer_free,
            answer_bearing=self.answer_bearing + other.answer_bearing,
            correct_final=self.correct_final + other.correct_final,
            wrong_final=self.wrong_final + other.wrong_final,
            unboxed_final=self.unboxed_final + other.unboxed_final,
            actions={
                k: self.actions.get(k, EvidenceTally()) + other.actions.get(k, EvidenceTally()) for k in keys
            },
        )

    def tallies(self) -> dict[str, EvidenceTally]:
        """Every kind's tally by name: the five kinds of turn, then the action classes present."""
        return {k: getattr(self, k) for k in TURN_KINDS} | dict(self.actions)

    def figures(self) -> dict[str, float]:
        """Flat figures for metrics and reports (``answer_free_mean_s``, ``correct_final_favoured_frac``,
        ``evidence_queries_grounded_mean_s``, ...); a mean or fraction appears only where it has turns."""
        out: dict[str, float] = {}
        for key, tally in self.tallies().items():
            name = key if key in TURN_KINDS else "evidence_" + key.replace("/", "_").replace("-", "_")
            out[f"{name}_turns"] = float(tally.turns)
            values = {"mean_s": tally.mean_s, "higher_frac": tally.higher_frac}
            if key == "answer_free":
                values["deadband_frac"] = tally.deadband_frac
            elif key == "correct_final":
                values["favoured_frac"] = tally.above_frac
                # how many could be favoured at all: the rest are written with near certainty
                values["room_frac"] = tally.room_frac
            elif key in ("wrong_final", "unboxed_final"):
                values["disfavoured_frac"] = tally.below_frac
            out |= {f"{name}_{k}": float(v) for k, v in values.items() if v is not None}
        return out


class NoiseFloor(Contract):
    """The null pass of a group (or the sum over groups): token differences and null turns."""

    tokens: NonNegInt = Field(default=0, description="loss tokens scored a second time")
    sum_d: Finite = 0.0
    sum_d2: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    max_abs_d: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    turns: NonNegInt = Field(default=0, description="turns of the null sample with a null s")
    outside: NonNegInt = Field(default=0, description="null turns with s > eps+ or s < -eps-")

    @classmethod
    def of(cls, differences, token_turns, *, eps_pos: float, eps_neg: float) -> NoiseFloor:
        """From the per-token differences null - student of one context and each token's turn."""
        d = np.asarray(differences, dtype=np.float64)
        turns = np.asarray(token_turns, dtype=np.int64)
        if d.shape != turns.shape:
            raise ValueError(f"differences ({d.shape}) and token_turns ({turns.shape}) must align")
        if d.size == 0:
            return cls()
        counts = np.bincount(turns)
        has = counts > 0
        null_s = np.bincount(turns, weights=d)[has] / counts[has]
        return cls(
            tokens=int(d.size),
            sum_d=float(d.sum()),
            sum_d2=float((d * d).sum()),
            max_abs_d=float(np.abs(d).max()),
            turns=int(has.sum()),
            outside=int(((null_s > eps_pos) | (null_s < -eps_neg)).sum()),
        )

    def __add__(self, other: NoiseFloor) -> NoiseFloor:
        return NoiseFloor(
            tokens=self.tokens + other.tokens,
            sum_d=self.sum_d + other.sum_d,
            sum_d2=self.sum_d2 + other.sum_d2,
            max_abs_d=max(self.max_abs_d, other.max_abs_d),
            turns=self.turns + other.turns,
            outside=self.outside + other.outside,
        )

    @property
    def mean(self) -> float | None:
        return self.sum_d / self.tokens if self.tokens else None

    @property
    def std(self) -> float | None:
        if not self.tokens:
            return None
        mu = self.sum_d / self.tokens
        return math.sqrt(max(0.0, self.sum_d2 / self.tokens - mu * mu))

    @property
    def outside_frac(self) -> float | None:
        return _fraction(self.outside, self.turns)

    def floor(self, tokens) -> np.ndarray:
        """|mu| + z sigma / sqrt(n) for turns of ``tokens`` tokens; NaN without a measurement."""
        n = np.maximum(np.asarray(tokens, dtype=np.float64), 1.0)
        if not self.tokens:
            return np.full(n.shape, np.nan)
        return abs(self.mean) + FLOOR_Z * self.std / np.sqrt(n)

    def within(self, evidence, tokens) -> np.ndarray:
        """Which turns' |s| lies within their floor (False for NaN s or without a measurement)."""
        s = np.abs(np.asarray(evidence, dtype=np.float64))
        with np.errstate(invalid="ignore"):
            return s <= self.floor(tokens)

    def figures(self) -> dict[str, float]:
        out = {"noise_tokens": float(self.tokens), "noise_turns": float(self.turns)}
        if self.tokens:
            out |= {"noise_mean": self.mean, "noise_std": self.std, "noise_max_abs": self.max_abs_d}
        if self.turns:
            out["noise_outside_deadband_frac"] = self.outside_frac
        return out
