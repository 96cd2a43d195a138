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
