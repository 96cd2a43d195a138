"""The credit viewer in a real headless browser (Debian's Chromium, driven by Playwright)."""

from __future__ import annotations

import shutil

import pytest

from agent.chat import ChatTokenizer
from proto.runs import PbsdSpec, RunSpec
from services.scorer.backends import LocalScorer
from services.scorer.evidence import score_group
from services.trainer.checkpoints import save_groups as _save_groups
from services.trainer.runs import RunStore
from tests.conftest import TOKEN
from tests.test_scorer import TEMPLATE, _group
from tests.test_trainer_service import _spec

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


@pytest.fixture
async def run_with_groups(api, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path):
    import redis.asyncio as aioredis

    from services.model.checkpoint import load_model

    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    scorer = LocalScorer(load_model(tiny_checkpoint))
    groups = [
        await score_group(
            _group(tok, PbsdSpec(teacher_template=TEMPLATE, eps_pos=0.0005, eps_neg=0.0005), rewards=r),
            tok,
            scorer,
        )
        for r in ((1.0, 0.0, 1.0), (0.0, 0.0, 1.0))
    ]
    client = aioredis.Redis.from_url(redis_url)
    store = RunStore(client, key_prefix)
    record = await store.create(RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint)))
    await store.request_cancel(record.id)  # keep the executor away from it
    out = tmp_path / "run"
    for step, g in enumerate(groups, start=1):
        _save_groups(out, step, [g])
    await store.update(record.id, output_dir=str(out))
    await client.aclose()
    return record.id, groups


def test_viewer_served_by_the_trainer_in_chromium(api, run_with_groups):
    assert CHROMIUM, "Chromium comes from the OS packages (scripts/bootstrap.sh installs it)"
    from playwright.sync_api import sync_playwright

    run_id, groups = run_with_groups
    trajectories = [t for g in groups for t in g.group.trajectories]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page()
        response = page.goto(f"{api}/runs/{run_id}/viewer?token={TOKEN}")
        assert response.status == 200, page.content()[:500]
        rows = page.locator("tr.traj")
        assert rows.count() == len(trajectories) == 6
        page.check("input[value=correct]")
        assert rows.count() == sum(t.reward > 0 for t in trajectories) == 3
        assert all(v == "true" for v in rows.evaluate_all("rs => rs.map(r => r.dataset.correct)"))
        page.check("input[value=incorrect]")
        assert rows.count() == 3
        page.check("input[value=all]")
        rows.nth(1).click()  # the second trajectory of the first group: three turns
        turns = page.locator("[data-testid=detail] [data-testid=turn]")
        assert turns.count() == 3
        detail = page.locator("[data-testid=detail]").inner_text()
        assert "Searching the web." in detail and "verified answer Danube" in detail
        labels = turns.evaluate_all("ts => ts.map(t => t.dataset.label)")
        expected = groups[0].turn_evidence[1]
        want = ["high" if s > 0.0005 else "low" if s < -0.0005 else "filtered" for s in expected]
        assert labels == want
        colours = turns.evaluate_all("ts => ts.map(t => getComputedStyle(t).borderLeftColor)")
        palette = {"high": "rgb(46, 157, 79)", "low": "rgb(208, 68, 58)", "filtered": "rgb(158, 158, 158)"}
        assert colours == [palette[x] for x in labels]
        assert f"s = {expected[0]:.4f}" in turns.nth(0).inner_text()
        browser.close()


def test_viewer_needs_the_token(api, run_with_groups):
    import httpx

    run_id, _ = run_with_groups
    assert httpx.get(f"{api}/runs/{run_id}/viewer").status_code == 401


async def test_viewer_of_a_run_without_saved_groups_is_a_404(
    api, redis_url, key_prefix, tiny_world, tiny_checkpoint
):
    import httpx
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    store = RunStore(client, key_prefix)
    record = await store.create(RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint)))
    await store.request_cancel(record.id)
    await client.aclose()
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        response = await http.get(f"{api}/runs/{record.id}/viewer")
        assert response.status_code == 404 and "--save-groups" in response.json()["detail"]
        assert (await http.get(f"{api}/runs/no-such-run/viewer")).status_code == 404


def test_viewer_tags_grounded_and_made_up_turns(tiny_checkpoint, tmp_path):
    from playwright.sync_api import sync_playwright

    from services.trainer.viewer import render_viewer, viewer_data
    from tests.test_grounding import _read, _search
    from tests.test_scorer import _trajectory
    from tests.test_trainer_policy import _scored

    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    result = '{"organic": [{"link": "kb://river/danube", "snippet": "The Danube flows through Vienna."}]}'
    made_up = _trajectory(
        tok, [_search("Zorbel river"), _read("kb://river/danube"), "\\boxed{Danube}"], result
    )
    made_up = made_up.model_copy(update={"final_answer": "Danube"})
    group = _group(tok, PbsdSpec(), rewards=(1.0,)).model_copy(update={"trajectories": (made_up,)})
    rows = viewer_data([(1, _scored(group, advantages=[0.0]))], tok)
    assert [t["grounded"] for t in rows[0]["turns"]] == [
        {"kind": "queries", "ok": False},
        {"kind": "reads", "ok": True},
        {"kind": "answers", "ok": True},
    ]

    # no null pass on these groups: no turn is judged against a floor
    assert {(t["floor"], t["within_floor"]) for t in rows[0]["turns"]} == {(None, None)}
    rows[0]["turns"][1] |= {"floor": 0.0123, "within_floor": True}  # as a measured floor would mark it

    page_file = tmp_path / "viewer.html"
    page_file.write_text(render_viewer(rows, summary="<p data-testid='sanity'>Teacher sanity: here.</p>"))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page()
        page.goto(page_file.as_uri())
        assert page.locator("[data-testid=sanity]").inner_text() == "Teacher sanity: here."
        page.locator("tr.traj").first.click()
        tags = page.locator("[data-testid=detail] [data-testid=turn] [data-testid=grounded]")
        assert tags.all_inner_texts() == ["made up", "grounded", "grounded"]
        floor = page.locator("[data-testid=detail] [data-testid=turn] [data-testid=within-floor]")
        assert floor.all_inner_texts() == ["\u2248 noise (floor 0.0123)"]
        browser.close()


def _groups(steps: int, per_step: int, size: int):
    """(step, group) stand-ins with ``size`` trajectories each: what shown_groups looks at."""
    from types import SimpleNamespace

    return [
        (s, SimpleNamespace(group=SimpleNamespace(trajectories=[f"{s}.{g}.{i}" for i in range(size)])))
        for s in range(1, steps + 1)
        for g in range(per_step)
    ]


def test_a_page_holds_whole_groups_of_every_step():
    from services.trainer.viewer import shown_groups

    groups = _groups(16, 4, 8)  # the demo's 512 trajectories
    assert shown_groups(groups, 600) == groups  # they fit: all of them
    page = shown_groups(groups, 400)  # 25 a step: three whole groups of each step
    assert sorted({s for s, _ in page}) == list(range(1, 17))
    assert all(sum(s == step for s, _ in page) == 3 for step in range(1, 17))
    assert all(page.count(g) == 1 for g in page) and len(page) * 8 <= 400
    one_each = shown_groups(groups, 128)  # room for one group a step
    assert [s for s, _ in one_each] == list(range(1, 17))
    fewer = [s for s, _ in shown_groups(groups, 100)]  # not even that: 12 steps, spread out
    assert fewer[0] == 1 and fewer[-1] == 16 and len(fewer) == len(set(fewer)) == 12
    # a long run whose steps do not all fit even one group: evenly spaced steps, first and last
    spread = shown_groups(_groups(300, 2, 8), 400)
    steps = [s for s, _ in spread]
    assert steps[0] == 1 and steps[-1] == 300 and len(steps) == len(set(steps)) == 50


def test_viewer_says_what_it_shows_and_pages_by_step(tmp_path):
    from playwright.sync_api import sync_playwright

    from services.trainer.viewer import render_viewer

    question = "Which city was the birthplace of the founder of the publisher of the novel " + "word " * 20
    rows = [
        {
            "id": f"t{step}.{i}",
            "step": step,
            "step_total": 4,
            "question": question,
            "answer": "Vienna",
            "final": None,
            "reward": 0.0,
            "correct": False,
            "advantage": 0.0,
            "finish": "max_turns",
            "algorithm": "pbsd",
            "turns": [],
        }
        for step in (1, 2, 3)
        for i in range(2 if step == 3 else 4)
    ]
    page_file = tmp_path / "viewer.html"
    page_file.write_text(render_viewer(rows))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page()
        page.goto(page_file.as_uri())
        shown = page.locator("[data-testid=shown]").inner_text()
        assert shown.startswith("Shown: 10 of the 12 trajectories of every step (1\u20133)"), shown
        options = page.locator("[data-testid=step] option").all_inner_texts()
        assert options == ["all steps", "step 1 (4)", "step 2 (4)", "step 3 (2 of 4)"]
        assert page.locator("tr.traj").count() == 10
        page.select_option("[data-testid=step]", "2")
        assert page.locator("tr.traj").count() == 4
        assert page.locator("[data-testid=count]").inner_text() == "4 trajectories"
        cell = page.locator("tr.traj td").nth(1)
        text = cell.inner_text()
        assert text.endswith("\u2026") and len(text) <= 91 and question.startswith(text[:-1])
        assert question[len(text) - 1] == " "  # cut between words
        assert cell.get_attribute("title") == question
        browser.close()


def test_a_hostile_run_name_and_page_text_stay_text(tmp_path):
    """A run named "{{DATA}}" once got every trajectory spliced, unescaped, into its heading; tool
    results are web pages, so their markup must neither run nor end the data's script element."""
    from playwright.sync_api import sync_playwright

    from services.trainer.viewer import render_viewer

    attack = '</script><img src=x onerror="window.pwned=1"><!-- <script>window.pwned=2</script>'
    rows = [
        {
            "id": "t1.0",
            "step": 1,
            "step_total": 1,
            "question": attack,
            "answer": "{{TITLE}}",
            "final": attack,
            "reward": 0.0,
            "correct": False,
            "advantage": 0.0,
            "finish": "answer",
            "algorithm": "grpo",
            "turns": [],
        }
    ]
    page_file = tmp_path / "viewer.html"
    page_file.write_text(render_viewer(rows, title="{{DATA}} of run <b>x</b>"))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page()
        page.goto(page_file.as_uri())
        assert page.locator("h1").inner_text() == "{{DATA}} of run <b>x</b>"
        assert page.locator("tr.traj").count() == 1
        assert page.locator("tr.traj td").nth(1).get_attribute("title") == attack
        assert page.locator("img").count() == 0
        assert page.evaluate("window.pwned") is None
        browser.close()


async def test_the_served_page_is_made_once_until_the_run_saves_more(
    api, run_with_groups, monkeypatch, tmp_path
):
    """Every reload of a long run's viewer decoded all its groups again, and concurrent ones did so
    side by side: the page is now kept until a step file changes."""
    import asyncio

    import httpx

    from services.trainer import viewer

    run_id, groups = run_with_groups
    made, real = [], viewer.run_page
    monkeypatch.setattr(viewer, "run_page", lambda *a, **k: made.append(a[0]) or real(*a, **k))
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        pages = await asyncio.gather(*(http.get(f"{api}/runs/{run_id}/viewer") for _ in range(4)))
        assert [p.status_code for p in pages] == [200] * 4 and len({p.text for p in pages}) == 1
        assert len(made) == 1
        assert (await http.get(f"{api}/runs/{run_id}/viewer", params={"limit": 3})).text != pages[0].text
        assert len(made) == 2  # another limit is another page
        _save_groups(tmp_path / "run", 3, [groups[0]])  # the run saves another step
        again = await http.get(f"{api}/runs/{run_id}/viewer")
        assert len(made) == 3 and again.text.count('"step"') > pages[0].text.count('"step"')


async def test_a_page_too_large_to_keep_is_made_each_time(api, run_with_groups, monkeypatch):
    import asyncio
    import time

    import httpx

    from services.trainer import viewer
    from services.trainer.api import ViewerPages

    run_id, _ = run_with_groups
    made, real = [], viewer.run_page
    monkeypatch.setattr(viewer, "run_page", lambda *a, **k: made.append(a[0]) or real(*a, **k))
    monkeypatch.setattr(ViewerPages, "kept_bytes", 1000)  # the page of six trajectories is larger
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        for _ in range(2):
            assert (await http.get(f"{api}/runs/{run_id}/viewer")).status_code == 200
        assert len(made) == 2
        # requests at the same time share one making, kept or not (it takes a second here, so
        # that they all come while it is made)
        monkeypatch.setattr(
            viewer, "run_page", lambda *a, **k: time.sleep(1) or made.append(a[0]) or real(*a, **k)
        )
        pages = await asyncio.gather(*(http.get(f"{api}/runs/{run_id}/viewer") for _ in range(3)))
        assert [p.status_code for p in pages] == [200] * 3 and len(made) == 3
