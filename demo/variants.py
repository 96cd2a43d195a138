"""The variants ``pbsd compare`` trains: named overrides of the demo's run spec, one entry each.

A variant's run is the demo's run spec (:func:`demo.run.run_spec`: the demo's sizes, the paper's
defaults of ``proto/runs.py`` for everything it leaves out) with the variant's ``overrides``
merged in key by key: a nested mapping is merged, any other value replaces what is there. Every
variant therefore shares the world, the warm policy, the data, the sampling, the optimiser and
the seeds, and differs only in what its overrides name. Adding a variant is adding an entry to
``VARIANTS``.

None of the variants replays routes in the policy update (``trainer.routing_replay``): the
ablation of evidence routing changes the evidence passes alone, as the paper's Table 1 does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from proto.templates import (
    ANSWER_FIRST_TEACHER_TEMPLATE,
    SUPPORT_FIRST_TEACHER_TEMPLATE,
    SUPPORT_TEACHER_TEMPLATE,
)

__all__ = ["VARIANTS", "Variant", "merge", "variant_spec"]


@dataclass(frozen=True)
class Variant:
    summary: str  # one line for --help and the report
    overrides: Mapping[str, Any] = field(default_factory=dict)


def merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in: mappings merged key by key, other values replaced."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


# The overrides the variants combine: PBSD with a teacher template, and the paper's two ablations
# of it, applied to the paper's note and to the short note the committed policy is taught to read
# (assets/demo-policy/RECIPE.md). From that policy the ablations mean something only against the
# teacher that reads x*, and the richer context only in the form that teacher reads.
def _pbsd(template: str | None = None) -> dict[str, Any]:
    return {"algorithm": {"name": "pbsd"} | ({"teacher_template": template} if template else {})}


_NO_DEADBAND = {"algorithm": {"eps_pos": 0.0, "eps_neg": 0.0}}
_REPLAY = {"algorithm": {"evidence_routing": "replay"}, "rollout": {"return_routed_experts": True}}

VARIANTS: dict[str, Variant] = {
    "grpo": Variant(
        "GRPO: every token of a trajectory gets its group advantage", {"algorithm": {"name": "grpo"}}
    ),
    "pbsd": Variant(
        "PBSD as in the paper: the answer-only teacher, deadband [-0.003, 0.001], fresh routing", _pbsd()
    ),
    "pbsd-support": Variant(
        "PBSD whose teacher is also told the question's supporting facts (beyond the paper: "
        "proto.templates.SUPPORT_TEACHER_TEMPLATE)",
        _pbsd(SUPPORT_TEACHER_TEMPLATE),
    ),
    "pbsd-answer-first": Variant(
        "PBSD with the answer-only note before the question, in a few words (the demo's teacher: "
        "proto.templates.ANSWER_FIRST_TEACHER_TEMPLATE)",
        _pbsd(ANSWER_FIRST_TEACHER_TEMPLATE),
    ),
    "pbsd-no-deadband": Variant(
        "PBSD with eps+ = eps- = 0, every turn weighted (Table 1's '0% filtered' ablation)",
        merge(_pbsd(), _NO_DEADBAND),
    ),
    "pbsd-replay": Variant(
        "PBSD with the evidence passes under the rollout's recorded routes "
        "(Table 1's 'w/o non-replay evidence-score recomputation')",
        merge(_pbsd(), _REPLAY),
    ),
    "pbsd-support-first": Variant(
        "PBSD with the answer-first note and the supporting facts on a second line (beyond the "
        "paper: proto.templates.SUPPORT_FIRST_TEACHER_TEMPLATE)",
        _pbsd(SUPPORT_FIRST_TEACHER_TEMPLATE),
    ),
    "pbsd-answer-first-no-deadband": Variant(
        "pbsd-answer-first with eps+ = eps- = 0 (Table 1's '0% filtered' over the short note)",
        merge(_pbsd(ANSWER_FIRST_TEACHER_TEMPLATE), _NO_DEADBAND),
    ),
    "pbsd-answer-first-replay": Variant(
        "pbsd-answer-first with the evidence passes under the rollout's recorded routes",
        merge(_pbsd(ANSWER_FIRST_TEACHER_TEMPLATE), _REPLAY),
    ),
}


def variant_spec(name: str, base: Mapping[str, Any]) -> dict[str, Any]:
    """The run spec of variant ``name`` over ``base``, checked as the trainer's API would check
    it (a spec the trainer would refuse fails here, before anything runs)."""
    from proto.runs import RunSpec

    if name not in VARIANTS:
        raise ValueError(f"no variant {name!r}; the variants are {', '.join(VARIANTS)}")
    spec = merge(base, VARIANTS[name].overrides)
    RunSpec.model_validate(spec)
    return spec
