"""The dashboard in headless Chromium against a real uvicorn on 127.0.0.1.

Needs Debian's chromium (`apt-get install -y chromium`) and `pip install playwright`; Playwright's
own browser download is never used.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import pytest

from lorarl.api import run_files
from lorarl.api.samples import append_samples
from lorarl.api.status import EvalRecord
from lorarl.server import KubeApi, KubeAuth, KubeStore, LocalStore, create_app
from tests.support.browser import ARGS, CHROMIUM, point_steps
from tests.support.fake_kube_auth import FakeKubeApi
from tests.support.fake_trainer import FakeTrainer
from tests.support.server_live import live_server
from tests.unit.test_server_local import make_job, write_run

STEPS = 12

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason="chromium not installed: apt-get install -y chromium"
)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def finished_run(tmp_path):
    write_run(tmp_path, steps=STEPS)
    store = LocalStore()
    store.add_finished(make_job("quickstart"), tmp_path)
    with live_server(create_app(store)) as url:
        yield url


@pytest.fixture
def page(browser):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.hosts = []
    page.on("request", lambda r: page.hosts.append(urlparse(r.url).netloc))
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    page.close()
    assert errors == [], f"JavaScript errors: {errors}"


def test_finished_run_shows_every_step(page, finished_run: str, tmp_path) -> None:
    page.goto(f"{finished_run}/?job=local/quickstart")
    page.wait_for_selector(f"#chart-reward circle[data-step='{STEPS}']")
    assert point_steps(page, "chart-reward") == list(range(1, STEPS + 1))
    assert point_steps(page, "chart-kl") == list(range(1, STEPS + 1))
    assert point_steps(page, "chart-sync") == list(range(1, STEPS + 1))
    # higher reward is drawn higher: y falls as reward (0.1 * step) rises
    ys = page.eval_on_selector_all(
        "#chart-reward circle", "els => els.map(e => +e.getAttribute('cy'))"
    )
    assert ys == sorted(ys, reverse=True) and ys[0] > ys[-1]
    assert page.text_content("#detail-title") == "local/quickstart"
    assert "Succeeded" in page.text_content("#detail-facts")
    assert page.locator("#jobs tbody tr").count() == 1
    assert page.is_hidden("#login")  # no auth locally
    shot = tmp_path / "dashboard.png"  # the README's picture comes from a real run (e2e test)
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    own = urlparse(finished_run).netloc
    assert set(page.hosts) == {own}, "the dashboard must load nothing from elsewhere"


def test_clicking_a_job_opens_its_charts(page, finished_run: str) -> None:
    page.goto(finished_run)
    page.wait_for_selector("#jobs tbody tr[data-job='local/quickstart']")
    assert page.is_hidden("#detail")
    page.click("#jobs tbody tr[data-job='local/quickstart']")
    page.wait_for_selector(f"#chart-reward circle[data-step='{STEPS}']")
    assert len(point_steps(page, "chart-reward")) == STEPS
    assert page.url.endswith("?job=local%2Fquickstart")


def test_running_job_refreshes(page) -> None:
    with FakeTrainer(job="live", total_steps=10) as trainer:
        trainer.step(2)
        store = LocalStore()
        store.add(make_job("live"), trainer.url)
        with live_server(create_app(store)) as url:
            page.goto(f"{url}/?job=local/live")
            page.wait_for_selector("#chart-reward circle[data-step='2']")
            assert len(point_steps(page, "chart-reward")) == 2
            trainer.step(3)
            page.wait_for_selector("#chart-reward circle[data-step='5']", timeout=10_000)
            assert point_steps(page, "chart-reward") == [1, 2, 3, 4, 5]


def test_kubernetes_dashboard_asks_for_a_token(page) -> None:
    kube = FakeKubeApi()
    try:
        kube.add_user("alice-token", "alice", ("get", "team-a"), ("list", "team-a"))
        kube.add_job("team-a", "a1")
        kube.add_job("team-b", "b1")
        api = KubeApi(kube.url, token=kube.server_token)
        app = create_app(KubeStore(api, progress_url="http://127.0.0.1:9"), auth=KubeAuth(api))
        with live_server(app) as url:
            page.goto(f"{url}/?job=team-a/a1")
            page.wait_for_selector("#login:not([hidden])")
            page.fill("#token", "alice-token")
            page.click("#login button")
            page.wait_for_selector("#jobs tbody tr[data-job='team-a/a1']")
            assert page.locator("#jobs tbody tr").count() == 1  # team-b stays invisible
            page.wait_for_selector("#detail-note:not([hidden])")
            assert "did not answer" in page.text_content("#detail-note")
            assert page.locator("#chart-reward circle").count() == 0
    finally:
        kube.stop()


def test_eval_accuracy_is_a_second_series_on_the_reward_chart(page, tmp_path) -> None:
    """Evals before training (step 0) and every 4 steps, accuracy rising: orange points at those
    steps, drawn higher as accuracy rises; the reward series keeps its own points."""
    write_run(tmp_path, steps=STEPS)
    history = run_files.read_history(tmp_path)
    acc = {0: 0.1, 4: 0.3, 8: 0.5, 12: 0.9}
    for r in history:
        if r.step in acc:
            r.eval = eval_record(r.step, acc[r.step])
    run_files.write_history(tmp_path, history)
    progress = run_files.read_progress(tmp_path)
    progress.baseline_eval, progress.eval = eval_record(0, acc[0]), history[-1].eval
    run_files.write_progress(tmp_path, progress)
    store = LocalStore()
    store.add_finished(make_job("quickstart"), tmp_path)
    with live_server(create_app(store)) as url:
        page.goto(f"{url}/?job=local/quickstart")
        page.wait_for_selector("#chart-reward circle[data-eval-step='12']")
        drawn = page.eval_on_selector_all(
            "#chart-reward circle[data-eval-step]",
            "els => els.map(e => [+e.dataset.evalStep, +e.dataset.value, +e.getAttribute('cy')])",
        )
        assert [(s, v) for s, v, _ in drawn] == list(acc.items())
        ys = [y for _, _, y in drawn]
        assert ys == sorted(ys, reverse=True) and ys[0] > ys[-1]
        assert point_steps(page, "chart-reward") == list(range(1, STEPS + 1))
        assert page.is_visible("#eval-legend")


def eval_record(step: int, accuracy: float) -> EvalRecord:
    return EvalRecord(
        step=step, reward_mean=accuracy, accuracy=accuracy, pass_at_k={"1": accuracy},
        prompts=8, samples_per_prompt=1, seconds=0.1,
    )  # fmt: skip


def test_samples_are_listed_newest_first_as_text(page, finished_run: str, tmp_path) -> None:
    """samples.jsonl of a finished run: one row per sample, newest step first, and a completion
    that looks like HTML stays text."""
    run_dir = tmp_path  # finished_run's files
    append_samples(run_dir, [
        {"step": s, "prompt": f"What is {s}+{i}?", "completion": f"<b>{s + i}</b>",
         "reward": float(i), "advantage": i - 0.5, "finish_reason": "stop"}
        for s in (4, 8) for i in range(2)
    ])  # fmt: skip
    page.goto(f"{finished_run}/?job=local/quickstart")
    page.wait_for_selector("#samples-block:not([hidden]) #samples tbody tr")
    rows = page.eval_on_selector_all(
        "#samples tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))"
    )
    assert [r[0] for r in rows] == ["8", "8", "4", "4"]
    assert rows[0][4:] == ["What is 8+1?", "<b>9</b>"] and rows[0][3] == "stop"
    assert page.locator("#samples b").count() == 0
