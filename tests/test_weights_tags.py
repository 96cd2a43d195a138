"""Weights are named ``<version>@<timeline>`` wherever a server is told what it serves: a server that
kept a version a resume abandoned is not taken for the new timeline's version of the same number."""

from __future__ import annotations

import pytest

from services.rollout.sglang import SglangEngine
from services.scorer.backends import SglangScorer
from services.sglang_control import tag_version
from services.weights.receiver import WeightReceiver
from services.weights.sender import WeightBroadcaster
from services.weights.tags import read_tag, same_weights, weights_tag
from tests.servers import serve
from tests.sglang_fake import make_sglang, take_tag
from tests.test_weights_receiver import Held


def test_a_tag_names_the_version_and_its_timeline():
    assert weights_tag(7, "a1b2c3d4") == "7@a1b2c3d4" and weights_tag(7) == "7"
    assert read_tag("7@a1b2c3d4") == (7, "a1b2c3d4") and read_tag("7") == (7, "")
    assert read_tag("default") is None and read_tag(None) is None and read_tag("x@t") is None
    assert read_tag("²@t") is None  # a digit to str.isdigit, not to int()
    # an answer's tag gives its trajectory's version: SGLang's "default" is the weights it started with
    assert [tag_version(t) for t in ("7@t", "7", "default", None)] == [7, 7, 0, None]
    assert same_weights("7@t", 7, "t") and same_weights("7", 7, "t")  # a bare number: by its number
    assert not same_weights("7@old", 7, "t") and not same_weights("6@t", 7, "t")


def _server(tag: str, path: str = "/models/fake"):
    app = make_sglang(lambda ids: [])
    take_tag(app, tag)
    app.state.model_path = path
    return app


def _loads(app) -> list[dict]:
    return [body for route, body in app.state.control if route == "update_weights_from_disk"]


@pytest.mark.parametrize("kind", ["rollout", "scorer"])
async def test_a_server_holding_an_abandoned_timelines_version_loads_the_disk_copy(kind):
    """The resume's timeline "new" broadcast version 4 (its disk copy: the checkpoint of version 3).
    A server left out of the group still holds version 5 of the timeline the resume abandoned: by
    its number it was current, and it sampled with lost weights under the new timeline's name."""
    abandoned = _server("5@old")
    member = _server("4@new")  # in the group: it has the broadcast
    copied = _server("3@new", path="/ckpt/step-3")  # it loaded the disk copy already
    # a trainer older than the tags broadcast a bare number: during a rolling upgrade (workers
    # first) its members are judged by that number, or every broadcast would be undone
    bare = _server("4")
    with serve(abandoned) as a, serve(member) as b, serve(copied) as c, serve(bare) as d:
        client = SglangEngine([a, b, c, d]) if kind == "rollout" else SglangScorer([a, b, c, d])
        await client.follow_broadcast(4, "/ckpt/step-3", 3, "new")
        await client.http.aclose()
    assert _loads(abandoned) == [
        {"model_path": "/ckpt/step-3", "weight_version": "3@new", "flush_cache": True}
    ]
    assert _loads(member) == _loads(copied) == _loads(bare) == []
    assert (client.weight_version if kind == "rollout" else client.version) == 3  # the oldest served
    with serve(abandoned) as a:  # now it holds the copy of the new timeline: left alone
        client = SglangEngine([a])
        await client.follow_broadcast(4, "/ckpt/step-3", 3, "new")
        await client.aclose()
    assert len(_loads(abandoned)) == 1


async def test_a_disk_load_names_the_timeline_and_is_not_repeated():
    app = _server("default")
    with serve(app) as url:
        engine = SglangEngine([url])
        for _ in range(2):  # the second replica to hear of it finds it served
            await engine.update_weights("/runs/r/weights/v000002-new", 2, "new")
        await engine.recheck("/runs/r/weights/v000002-new", 2, "new")
        await engine.aclose()
    assert [b["weight_version"] for b in _loads(app)] == ["2@new"]


async def test_the_sender_judges_receivers_by_version_and_timeline(monkeypatch):
    """Behind: a receiver that serves another version, or this version of another timeline. Ours report
    the bare number (their worker keeps the timeline), and are judged by it."""
    sender = WeightBroadcaster(
        ["http://a", "http://b", "http://c", "http://d", "http://e"], master_address="127.0.0.1"
    )
    sender.sent, sender.timeline = 4, "new"
    served = {
        "http://a": "4@new",
        "http://b": "4",
        "http://c": "4@old",
        "http://d": None,
        "http://e": "3@new",
    }

    async def by_url():
        return served

    monkeypatch.setattr(sender, "_served_by_url", by_url)
    assert await sender.behind() == ["http://c", "http://e"]
    await sender.aclose()


async def test_our_receiver_takes_a_tagged_version_and_refuses_a_bare_word(monkeypatch):
    target = Held()
    receiver = WeightReceiver(lambda: target)
    monkeypatch.setattr(receiver, "_receive", lambda *args: None)
    receiver.groups["g"] = (object(), "gloo")
    receiver.begin()
    body = {"names": [], "dtypes": [], "shapes": [], "group_name": "g"}
    assert (await receiver.update({**body, "weight_version": "3@new"}))[0]
    assert target.calls[-1] == ("release", 3)
    ok, message = await receiver.update({**body, "weight_version": "latest"})
    assert not ok and "not a version number" in message
