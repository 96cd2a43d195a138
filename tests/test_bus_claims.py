"""Claims against a real redis-server: a work stream's large entry names a value that holds its
payload, consumers read it through the name, and the value lives exactly as long as its entry is
needed (services/bus/claims.py)."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ResponseError

from proto import examples as ex
from proto.base import encode
from proto.streams import DEAD_LETTERS, PROMPTS, TRAJECTORIES, WEIGHTS
from services.bus import Bus
from services.bus.claims import add_claimed, index_key
from services.bus.connection import entry_order
from services.trainer.dead_letters import lost_task
from tests.test_bus import FAST, _run_until


@pytest.fixture
async def claiming(redis_url, key_prefix):
    """A bus that claims every payload past 100 bytes: a prompt or a small group goes by claim."""
    bus = Bus.from_url(redis_url, prefix=key_prefix, claim_bytes=100)
    yield bus
    await bus.close()


async def _index(bus: Bus, stream) -> dict[str, str]:
    """Each claim of the stream's index and its entry id (checking the score is the id's millisecond)."""
    pairs = await bus.redis.zrange(index_key(bus.key(stream)), 0, -1, withscores=True)
    members = {m.decode().split(" ")[1]: (m.decode().split(" ")[0], int(score)) for m, score in pairs}
    for entry_id, score in members.values():
        assert score == entry_order(entry_id)[0]  # scored by its entry's millisecond
    return {claim: entry_id for claim, (entry_id, _score) in members.items()}


async def _entries(bus: Bus, stream) -> list[tuple[str, dict]]:
    return [(i.decode(), f) for i, f in await bus.redis.xrange(bus.key(stream))]


async def test_a_large_entry_names_its_claim_and_is_consumed_whole(claiming: Bus):
    groups = [ex.example_group(2, seed=i) for i in range(3)]
    for group in groups:
        await claiming.publish(TRAJECTORIES, group)
    index = await _index(claiming, TRAJECTORIES)
    for entry_id, fields in await _entries(claiming, TRAJECTORIES):
        assert set(fields) == {b"type", b"mid", b"claim", b"task"}  # no payload in the stream
        claim = fields[b"claim"].decode()
        assert index[claim] == entry_id
        assert await claiming.redis.ttl(claim) == -1  # persistent once its entry is there
    seen = []

    async def handler(message, delivery):
        seen.append(message)

    assert [m for _i, m in await claiming.read_all(TRAJECTORIES)] == groups
    await _run_until(claiming, TRAJECTORIES, handler, lambda: len(seen) == 3)
    assert seen == groups
    await claiming.trim_acked(TRAJECTORIES)  # every entry acknowledged: their values go with them
    assert await _entries(claiming, TRAJECTORIES) == [] and await _index(claiming, TRAJECTORIES) == {}
    assert await claiming.redis.keys(f"{claiming.key(TRAJECTORIES)}:claim:*") == []


async def test_small_entries_and_broadcast_streams_carry_their_payload(bus: Bus, claiming: Bus):
    """The default threshold is a read slice (4 MiB): a prompt goes whole. A broadcast stream,
    trimmed by MAXLEN, which knows nothing of claims, never claims, whatever the size."""
    await bus.publish(PROMPTS, ex.example_task())
    await claiming.publish(WEIGHTS, ex.example_weights(1))
    for stream in (PROMPTS, WEIGHTS):
        [(_id, fields)] = await _entries(bus, stream)
        assert b"data" in fields and b"claim" not in fields
    assert (await claiming.latest(WEIGHTS))[1].version == 1


async def test_trimming_unlinks_the_claims_of_acknowledged_entries_only(claiming: Bus):
    for i in range(6):
        await claiming.publish(PROMPTS, ex.example_task(i))
        await asyncio.sleep(0.002)  # entries of their own milliseconds
    await claiming.ensure_group(PROMPTS)
    read = await claiming.redis.xreadgroup("rollout", "c", {claiming.key(PROMPTS): ">"}, count=4)
    ids = [i for i, _f in read[0][1]]
    await claiming.redis.xack(claiming.key(PROMPTS), "rollout", *ids[:3])  # the fourth stays pending
    assert await claiming.trim_acked(PROMPTS) == 3
    left = await _entries(claiming, PROMPTS)
    assert len(left) == 3
    assert sorted(await _index(claiming, PROMPTS)) == sorted(f[b"claim"].decode() for _i, f in left)
    claims = await claiming.redis.keys(f"{claiming.key(PROMPTS)}:claim:*")
    assert len(claims) == 3  # the trimmed entries' values are gone with them
    assert [m.index for _i, m in await claiming.read_all(PROMPTS)] == [3, 4, 5]


async def test_publishing_ahead_scores_the_queued_claims_anew(claiming: Bus):
    """publish_ahead adds the queued entries again under new ids: their claims, scored by the old
    ones, would be unlinked by a trim below the new ids while the entries wait to be read."""
    await claiming.ensure_group(PROMPTS)
    for i in range(3):
        await claiming.publish(PROMPTS, ex.example_task(i))
    await asyncio.sleep(0.005)
    assert await claiming.publish_ahead(PROMPTS, [ex.example_task(9)]) == 3
    entries = await _entries(claiming, PROMPTS)
    index = await _index(claiming, PROMPTS)
    queued = [(i, f) for i, f in entries if b"claim" in f]
    assert len(queued) == 3 and len(index) == 3
    for entry_id, fields in queued:
        assert index[fields[b"claim"].decode()] == entry_id  # not the id it had before
    # the handed-back prompt is read and acknowledged: the trim passes it, the queued stay whole
    key = claiming.key(PROMPTS)
    [[_key, [(ahead_id, _fields)]]] = await claiming.redis.xreadgroup("rollout", "c", {key: ">"}, count=1)
    await claiming.redis.xack(key, "rollout", ahead_id)
    assert await claiming.trim_acked(PROMPTS) == 1
    assert len(await _index(claiming, PROMPTS)) == 3
    got = []

    async def handler(message, delivery):
        got.append(message.index)

    await _run_until(claiming, PROMPTS, handler, lambda: len(got) == 3)
    assert got == [0, 1, 2]


async def test_a_claim_gone_while_its_entry_is_pending_is_a_dead_letter(claiming: Bus):
    group = ex.example_group(2)
    await claiming.publish(TRAJECTORIES, group)
    [(entry_id, fields)] = await _entries(claiming, TRAJECTORIES)
    await claiming.redis.delete(fields[b"claim"])  # Redis lost it (an eviction policy, by hand)

    async def handler(message, delivery):
        raise AssertionError("nothing to handle")

    await _run_until(claiming, TRAJECTORIES, handler, claiming.dead_letters)
    [letter] = await claiming.dead_letters()
    assert letter.entry_id == entry_id and "gone" in letter.cause and letter.payload == b""
    # named from the entry, so the trainer replaces the prompt (a letter without it waits for good)
    assert lost_task(letter) == group.task_ref()
    assert (await claiming.redis.xpending(claiming.key(TRAJECTORIES), "scorer"))["pending"] == 0


async def test_a_claim_gone_under_another_consumers_entry_is_passed_over(claiming: Bus):
    """The value is gone while another consumer holds the entry (it took the entry over from this
    one, which stalled as it read): the entry is the other's to settle. No dead letter from this
    one, nothing acknowledged."""
    await claiming.publish(TRAJECTORIES, ex.example_group(2))
    await claiming.ensure_group(TRAJECTORIES)
    read = await claiming.redis.xreadgroup("scorer", "other", {claiming.key(TRAJECTORIES): ">"})
    [(entry_id, fields)] = read[0][1]
    await claiming.redis.delete(fields[b"claim"])
    admitted = await claiming._admit(TRAJECTORIES, "scorer", "late", entry_id.decode(), fields, True, FAST)
    assert admitted is None
    assert await claiming.dead_letters() == []
    pending = await claiming.redis.xpending(claiming.key(TRAJECTORIES), "scorer")
    assert pending["pending"] == 1


async def test_a_claimed_entry_delivered_too_often_keeps_its_payload_in_the_letter(claiming: Bus):
    group = ex.example_group(2)
    await claiming.publish(TRAJECTORIES, group)

    async def handler(message, delivery):
        raise RuntimeError("scorer bug")

    await _run_until(claiming, TRAJECTORIES, handler, claiming.dead_letters)
    [letter] = await claiming.dead_letters()
    assert letter.payload_kept == "whole" and letter.payload == encode(group)
    assert letter.task is not None and letter.task.task_id == group.task_id
    assert await claiming.redis.xlen(claiming.key(DEAD_LETTERS)) == 1


async def test_a_claim_that_expired_before_its_entry_is_refused(claiming: Bus):
    """The publisher writes the value with an expiry; the script that adds the entry refuses a
    value that is not there, rather than add an entry that names nothing."""
    from services.bus import claims

    key = claiming.key(TRAJECTORIES)
    with pytest.raises(ResponseError, match="NOCLAIM"):
        await claiming.redis.eval(
            claims._ADD, 3, key, index_key(key), f"{key}:claim:gone", "TrajectoryGroup", "m", ""
        )
    assert await claiming.redis.exists(key, index_key(key)) == 0


async def test_a_claim_written_but_never_added_expires(claiming: Bus, monkeypatch):
    from services.bus import claims

    async def dies(*args, **kwargs):
        raise ConnectionError("the publisher died between the SET and the XADD")

    monkeypatch.setattr(claiming.redis, "eval", dies)
    with pytest.raises(ConnectionError):
        await add_claimed(
            claiming.redis, claiming.key(TRAJECTORIES), "TrajectoryGroup", "m", b"x" * 200, None
        )
    [claim] = await claiming.redis.keys(f"{claiming.key(TRAJECTORIES)}:claim:*")
    assert 0 < await claiming.redis.ttl(claim) <= claims.WRITE_TTL_S


async def test_an_entry_added_twice_is_a_duplicate_once_its_claim_is_gone(claiming: Bus):
    """A client that lost the script's reply sends it again: two entries name one claim. The first
    is processed and trimmed with the claim; the second is acknowledged as a duplicate by its
    message id, not dead-lettered as lost (which would have its prompt sampled again)."""
    from services.bus import claims

    group, key = ex.example_group(2), claiming.key(TRAJECTORIES)
    await claiming.ensure_group(TRAJECTORIES)
    await claiming.redis.set(f"{key}:claim:twice", encode(group), px=60_000)
    for _ in range(2):
        await claiming.redis.eval(
            claims._ADD, 3, key, index_key(key), f"{key}:claim:twice", "TrajectoryGroup", group.message_id, ""
        )
    seen = []

    async def handler(message, delivery):
        seen.append(message)

    # read one at a time: the first is acknowledged and trimmed, its claim with it, before the second
    async def settled() -> bool:
        pending = (await claiming.redis.xpending(key, "scorer"))["pending"]
        return not pending and await claiming.redis.xlen(key) <= 1

    await _run_until(claiming, TRAJECTORIES, handler, settled)
    assert seen == [group] and await claiming.dead_letters() == []


async def test_a_trim_unlinks_every_claim_below_its_floor_in_one_millisecond(claiming: Bus):
    """Ids of one millisecond sort as text in the index ("5-10" before "5-9"): the claims below the
    floor are told by their whole ids, however many share the floor's millisecond."""
    key, index = claiming.key(TRAJECTORIES), index_key(claiming.key(TRAJECTORIES))
    for seq in range(1, 301):
        await claiming.redis.xadd(
            key, {b"type": b"TrajectoryGroup", b"mid": f"m{seq}", b"claim": f"c{seq}"}, id=f"5-{seq}"
        )
        await claiming.redis.set(f"{key}:c{seq}", b"v")
        await claiming.redis.zadd(index, {f"5-{seq} {key}:c{seq}": 5})
    await claiming.redis.xgroup_create(key, "scorer", id="5-149")  # read and acknowledged to 5-149
    assert await claiming.trim_acked(TRAJECTORIES) == 149
    left = sorted(
        int(m.decode().split(" ")[0].split("-")[1]) for m in await claiming.redis.zrange(index, 0, -1)
    )
    assert left == list(range(150, 301))
    assert await claiming.redis.exists(*(f"{key}:c{seq}" for seq in range(1, 301))) == 151


async def test_a_processed_message_is_acknowledged_without_reading_its_value(claiming: Bus, monkeypatch):
    """An entry added twice: once the first is processed, the second is a duplicate by its message
    id, and its 200 MB value is not read to find that out."""
    from services.bus import groups

    group = ex.example_group(2)
    await claiming.publish(TRAJECTORIES, group)
    await claiming.ensure_group(TRAJECTORIES)
    [[_key, [(entry_id, fields)]]] = await claiming.redis.xreadgroup(
        "scorer", "c1", {claiming.key(TRAJECTORIES): ">"}
    )
    await claiming.redis.set(claiming._done_key(TRAJECTORIES, "scorer", group.message_id), b"1")

    async def never(*args):
        raise AssertionError("the value was read")

    monkeypatch.setattr(groups, "payload_of", never)
    assert await claiming._admit(TRAJECTORIES, "scorer", "c1", entry_id.decode(), fields, False, FAST) is None
    assert (await claiming.redis.xpending(claiming.key(TRAJECTORIES), "scorer"))["pending"] == 0


async def test_a_claimed_entry_whose_task_is_not_a_task_is_a_letter_without_one(claiming: Bus):
    from services.bus.claims import claimed_task

    assert claimed_task({b"task": b'{"run_id": "r"}'}) is None and claimed_task({}) is None
    assert claimed_task({b"task": ex.example_group(2).task_ref().model_dump_json().encode()}) is not None


async def test_an_index_member_the_bus_did_not_write_does_not_stop_the_trim(claiming: Bus):
    """A member without "<id> <claim>" (written by hand) is left alone: failing on it would fail
    every trim after, and the claims would pile up."""
    key = claiming.key(TRAJECTORIES)
    await claiming.publish(TRAJECTORIES, ex.example_group(2))
    await claiming.redis.zadd(index_key(key), {"not a member": 1})
    await claiming.ensure_group(TRAJECTORIES)
    [[_key, [(entry_id, _fields)]]] = await claiming.redis.xreadgroup("scorer", "c1", {key: ">"})
    await claiming.redis.xack(key, "scorer", entry_id)
    assert await claiming.trim_acked(TRAJECTORIES) == 1
    assert await claiming.redis.keys(f"{key}:claim:*") == []
    assert await claiming.redis.zrange(index_key(key), 0, -1) == [b"not a member"]
