"""Weights timelines (issue 25, item 1): which (timeline, version) pairs a resumed run still trains
on, worked out by hand, and the admission of groups sampled with each."""

from __future__ import annotations

from proto.runs import RunSpec
from services.trainer.admission import accept
from services.trainer.checkpoints import TrainState
from services.trainer.runs import RunStore
from services.trainer.timelines import lineage, lost_weights
from tests.test_trainer_service import _one_token, _spec


def test_lineage_by_hand():
    # a run starts: nothing before it
    assert lineage([], checkpoint=None) == {}
    # A checkpoints at 2 and 4 and dies at 5; B resumes from 4: A holds up to 4
    assert lineage(["A"], checkpoint=("A", 4, {})) == {"A": 4}
    # B dies before its first checkpoint, C resumes from A's 4 again: of B only its opening 4 holds
    assert lineage(["A", "B"], checkpoint=("A", 4, {})) == {"A": 4, "B": 4}
    # C checkpoints at 6 and dies; D resumes from C's 6: C's lineage is kept, C holds up to 6
    assert lineage(["A", "B", "C"], checkpoint=("C", 6, {"A": 4, "B": 4})) == {"A": 4, "B": 4, "C": 6}
    # a crash before the first checkpoint: the run begins again from its model, version 0 of each
    assert lineage(["A", "B"], checkpoint=None) == {"A": 0, "B": 0}
    # a checkpoint written before timelines were recorded
    assert lineage([], checkpoint=("", 3, {})) == {}


def test_lost_weights_by_hand():
    kept = {"A": 4, "B": 4}
    assert lost_weights({}, current="C", lineage=kept) is None  # a sender that names no timeline
    assert lost_weights({"C": 9}, current="C", lineage=kept) is None
    assert lost_weights({"A": 4}, current="C", lineage=kept) is None  # the checkpoint's own weights
    assert lost_weights({"A": 5}, current="C", lineage=kept) == ("A", 5)
    assert lost_weights({"A": 4, "C": 5}, current="C", lineage=kept) is None  # sampled across the resume
    assert lost_weights({"A": 5, "C": 5}, current="C", lineage=kept) == ("A", 5)
    assert lost_weights({"X": 0}, current="C", lineage=kept) == ("X", 0)  # a timeline the run never had


async def test_a_group_sampled_with_a_discarded_version_is_dropped_and_its_prompt_sampled_again(
    bus, key_prefix, tiny_world, tiny_checkpoint
):
    """The trainer resumed in timeline B from A's checkpoint at version 2 and is at version 3 again:
    A's version 3 has the same number as B's and is within the staleness bound, but other weights."""
    from agent.chat import ChatTokenizer
    from proto.messages import TrajectoryGroup
    from services.scorer.evidence import score_group

    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    store = RunStore(bus.redis, key_prefix)
    spec = RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint))
    state = TrainState(step=3, version=3, timeline="B", lineage={"A": 2})
    again: list[tuple[int, str]] = []

    async def republish(index: int, cause: str) -> None:
        again.append((index, cause))

    async def group(index: int, version: int, timelines: dict[str, int]):
        t = _one_token(f"r1:{index}/0", policy_version=version)
        g = TrajectoryGroup(
            message_id=f"g{index}",
            run_id="r1",
            task_id=f"r1:{index}",
            question_id="q",
            question="q",
            answer="a",
            policy_version=version,
            policy_timelines=timelines,
            algorithm=spec.algorithm,
            trajectories=(t,),
        )
        return await score_group(g, tok, None)

    batch: set[str] = set()

    async def admit(index, version, timelines):
        return await accept(
            store,
            "r1",
            spec,
            state,
            await group(index, version, timelines),
            batch_ids=batch,
            vocab=tok.vocab_size,
            again=republish,
        )

    assert not await admit(7, 3, {"A": 3})  # the bug: trained, as version 3 within the bound
    assert await admit(8, 2, {"A": 2})  # A's version 2 is the checkpoint's weights
    assert await admit(9, 3, {"B": 3})
    assert await admit(10, 2, {"A": 2, "B": 3})  # sampled across the resume, from kept weights
    assert not await admit(11, 2, {"A": 3, "B": 3})  # partly with the lost version
    await store.mark_trained("r1", ["r1:12/0"])
    assert not await admit(12, 3, {"A": 3})  # lost, but another copy was trained: not sampled again
    assert state.drops == {"lost": 3} and state.dropped == 0  # sampled again, not replaced
    assert again == [(7, "g7"), (11, "g11")]
    assert await store.dropped("r1") == set()
