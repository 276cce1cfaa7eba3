"""The dashboard in headless Chromium against a real uvicorn on 127.0.0.1.

Needs Debian's chromium (`apt-get install -y chromium`) and `pip install playwright`; Playwright's
own browser download is never used. The charts are uPlot canvases: the tests read what the page
handed uPlot (window.lorarlCharts), its legend as the cursor moves, and the canvas pixels.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import pytest

from harness.cluster.status_auth import world as status_world
from harness.engines.fake_trainer import FakeTrainer
from harness.services.browser import ARGS, CHROMIUM, point_steps, wait_for_step
from harness.services.server_live import live_server
from lorarl.api.reports import run_files
from lorarl.api.reports.samples import append_samples
from lorarl.api.reports.status import EvalRecord
from lorarl.server import KubeAuth, KubeStore, LocalStore, create_app
from tests.unit.server.test_server_local import make_job, write_run

STEPS = 12
OTHER_STEPS = 8
ALL_CHARTS = ["reward", "kl", "entropy", "length", "clip", "sync", "tps"]
EVALS = {0: 0.1, 4: 0.3, 8: 0.5, 12: 0.9}

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
def two_runs(tmp_path):
    """`quickstart` (12 steps, reward 0.1*step, KL 0.001*step^2, evals at EVALS) and `other`
    (8 steps, reward 1 - 0.05*step, KL twice quickstart's but missing at step 3)."""
    first, second = tmp_path / "quickstart", tmp_path / "other"
    write_run(first, steps=STEPS)
    add_evals(first)
    write_run(second, steps=OTHER_STEPS)
    history = run_files.read_history(second)
    for r in history:
        r.reward_mean, r.kl = 1.0 - 0.05 * r.step, None if r.step == 3 else 2 * r.kl
    run_files.write_history(second, history)
    store = LocalStore()
    store.add_finished(make_job("quickstart"), first)
    store.add_finished(make_job("other"), second)
    with live_server(create_app(store)) as url:
        yield url


@pytest.fixture
def page(browser):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.hosts = []
    page.on("request", lambda r: page.hosts.append(urlparse(r.url).netloc))
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on(
        "console",
        lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None,
    )
    yield page
    page.close()
    assert errors == [], f"JavaScript errors or CSP violations: {errors}"


def add_evals(run_dir: Path) -> None:
    history = run_files.read_history(run_dir)
    for r in history:
        if r.step in EVALS:
            r.eval = eval_record(r.step, EVALS[r.step])
    run_files.write_history(run_dir, history)
    progress = run_files.read_progress(run_dir)
    progress.baseline_eval, progress.eval = eval_record(0, EVALS[0]), history[-1].eval
    run_files.write_progress(run_dir, progress)


def eval_record(step: int, accuracy: float) -> EvalRecord:
    return EvalRecord(
        step=step, reward_mean=accuracy, accuracy=accuracy, pass_at_k={"1": accuracy},
        prompts=8, samples_per_prompt=1, seconds=0.1,
    )  # fmt: skip


def legend(page, chart: str) -> list[tuple[str, str]]:
    """(label, value) of each legend row: the step first, then every series."""
    rows = page.eval_on_selector_all(
        f"#chart-{chart} .u-legend .u-series",
        "rows => rows.map(r => [r.querySelector('.u-label').textContent,"
        " r.querySelector('.u-value').textContent])",
    )
    return [tuple(row) for row in rows]


def hover(page, chart: str, step: int) -> None:
    """A real mouse move over the plot area, at the x where `step` is drawn."""
    box = page.locator(f"#chart-{chart} .u-over").bounding_box()
    x = page.evaluate(f"lorarlCharts['{chart}'].valToPos({step}, 'x')")
    page.mouse.move(box["x"] + x, box["y"] + box["height"] / 2)


def colour_rows(page, chart: str, rgb: tuple[int, int, int]) -> list[tuple[int, int]]:
    """(x, y) of the canvas pixels painted exactly in `rgb`."""
    return page.evaluate(
        """([chart, rgb]) => { const c = document.querySelector(`#chart-${chart} canvas`);
            const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data; const out = [];
            for (let i = 0; i < d.length; i += 4)
              if (d[i] === rgb[0] && d[i + 1] === rgb[1] && d[i + 2] === rgb[2])
                out.push([(i / 4) % c.width, Math.floor(i / 4 / c.width)]);
            return out; }""",
        [chart, list(rgb)],
    )


def test_finished_run_draws_every_metric_with_axes(page, finished_run: str, tmp_path) -> None:
    response = page.goto(f"{finished_run}/?job=local/quickstart")
    assert "default-src 'self'" in response.headers["content-security-policy"]
    wait_for_step(page, "reward", STEPS)
    every = list(range(1, STEPS + 1))
    for chart in ("reward", "kl", "entropy", "sync", "tps"):
        assert point_steps(page, chart) == every, chart
        assert page.locator(f"#chart-{chart}.empty").count() == 0
    for chart in ("length", "clip"):  # the fixture has no lengths or clip fractions: no data
        assert point_steps(page, chart) == [] and page.is_visible(f"#chart-{chart} .no-data")
    axes = page.evaluate(
        "Object.entries(lorarlCharts).map(([k, u]) => [k, u.axes.map(a => a.label)])"
    )
    assert dict(axes) == {
        "reward": ["step", "reward / accuracy"], "kl": ["step", "KL"],
        "entropy": ["step", "entropy"], "length": ["step", "tokens"],
        "clip": ["step", "fraction of tokens"], "sync": ["step", "seconds"],
        "tps": ["step", "tokens/s"],
    }  # fmt: skip
    # Drawn for real: the run's colour (#1a6fd1) on the canvas, higher on the right (reward rises).
    pixels = colour_rows(page, "reward", (0x1A, 0x6F, 0xD1))
    assert len(pixels) > 100
    xs = sorted(x for x, _ in pixels)
    left = [y for x, y in pixels if x < xs[len(xs) // 4]]
    right = [y for x, y in pixels if x > xs[3 * len(xs) // 4]]
    assert sum(left) / len(left) > sum(right) / len(right) + 50
    assert page.text_content("#detail-title") == "local/quickstart"
    assert "Succeeded" in page.text_content("#detail-facts")
    assert page.locator("#jobs tbody tr").count() == 1
    assert page.is_hidden("#login")  # no auth locally
    shot = tmp_path / "dashboard.png"  # the README's picture comes from a real run (e2e test)
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    own = urlparse(finished_run).netloc
    assert set(page.hosts) == {own}, "the dashboard must load nothing from elsewhere"
    assert any(h.endswith("uPlot.iife.min.js") for h in page.evaluate(
        "performance.getEntriesByType('resource').map(e => e.name)"))  # fmt: skip


def test_two_runs_share_the_charts_and_hover_shows_values(page, two_runs: str) -> None:
    """Runs are plotted in the job list's order (`other` first), each in its own colour."""
    page.goto(f"{two_runs}/?job=local/quickstart&plot=local/other")
    wait_for_step(page, "reward", OTHER_STEPS)
    page.wait_for_function("() => lorarlCharts.kl.series.length === 3")
    assert [label for label, _ in legend(page, "reward")] == [
        "step", "other reward", "quickstart reward", "quickstart eval accuracy"]  # fmt: skip
    assert [label for label, _ in legend(page, "kl")] == ["step", "other", "quickstart"]
    for chart in ALL_CHARTS:
        per_run = {"reward": 2, "clip": 3}.get(chart, 1)
        extra = -1 if chart == "reward" else 0  # `other` has no evals: no eval series
        assert page.evaluate(f"lorarlCharts['{chart}'].series.length") == 1 + 2 * per_run + extra
    strokes = page.evaluate("lorarlCharts.kl.series.slice(1).map(s => s._stroke)")
    assert len(set(strokes)) == 2
    assert point_steps(page, "reward", 1) == list(range(1, OTHER_STEPS + 1))
    assert point_steps(page, "reward", 2) == list(range(1, STEPS + 1))
    assert point_steps(page, "reward", 3) == list(EVALS)  # the evals, step 0 included
    assert point_steps(page, "kl", 1) == [s for s in range(1, OTHER_STEPS + 1) if s != 3]
    # step 3 of `other` has no KL: a gap (null), not a zero; its missing steps 9-12 are not gaps
    kl = "lorarlCharts.kl.data[1]"
    assert page.evaluate(f"[{kl}[2] === null, {kl}[10] === undefined]") == [True, True]
    swatches = page.eval_on_selector_all(".swatch", "els => els.map(e => e.style.background)")
    assert len(set(swatches)) == 2 and "transparent" not in swatches
    hover(page, "kl", 7)
    assert legend(page, "kl") == [("step", "7"), ("other", "0.098"), ("quickstart", "0.049")]
    # the cursor is synced: the reward chart shows the same step
    assert legend(page, "reward") == [
        ("step", "7"), ("other reward", "0.65"), ("quickstart reward", "0.7"),
        ("quickstart eval accuracy", "–")]  # fmt: skip
    hover(page, "kl", 3)
    assert legend(page, "kl") == [("step", "3"), ("other", "–"), ("quickstart", "0.009")]
    hover(page, "reward", 8)
    assert legend(page, "reward")[3] == ("quickstart eval accuracy", "0.5")


def test_clicking_and_ticking_jobs_picks_the_runs(page, two_runs: str) -> None:
    page.goto(two_runs)
    page.wait_for_selector("#jobs tbody tr[data-job='local/quickstart']")
    assert page.is_hidden("#detail") and page.is_hidden("#charts-section")
    page.click("#jobs tbody tr[data-job='local/quickstart'] td:nth-child(3)")
    wait_for_step(page, "reward", STEPS)
    assert page.evaluate("lorarlCharts.kl.series.length") == 2  # x and one run
    assert page.url.endswith("?job=local%2Fquickstart")
    assert page.is_disabled("input[data-plot='local/quickstart']")
    page.check("input[data-plot='local/other']")
    page.wait_for_function("() => lorarlCharts.kl.series.length === 3")
    assert "plot=local%2Fother" in page.url
    assert page.text_content("#detail-title") == "local/quickstart"  # ticking does not select
    page.uncheck("input[data-plot='local/other']")
    page.wait_for_function("() => lorarlCharts.kl.series.length === 2")


def test_running_job_refreshes(page) -> None:
    with FakeTrainer(job="live", total_steps=10) as trainer:
        trainer.step(2)
        store = LocalStore()
        store.add(make_job("live"), trainer.url)
        with live_server(create_app(store)) as url:
            page.goto(f"{url}/?job=local/live")
            wait_for_step(page, "reward", 2)
            assert point_steps(page, "reward") == [1, 2]
            trainer.step(3)
            wait_for_step(page, "reward", 5)
            assert point_steps(page, "reward") == [1, 2, 3, 4, 5]


def test_kubernetes_dashboard_asks_for_a_token(page, tmp_path) -> None:
    """On a real API server: alice's bound token may see team-a's jobs only."""
    with status_world(tmp_path / "cp") as world:
        api = world.api()
        app = create_app(KubeStore(api, progress_url="http://127.0.0.1:9"), auth=KubeAuth(api))
        with live_server(app) as url:
            page.goto(f"{url}/?job=team-a/a1")
            page.wait_for_selector("#login:not([hidden])")
            page.fill("#token", world.tokens["alice"])
            page.click("#login button")
            page.wait_for_selector("#jobs tbody tr[data-job='team-a/a1']")
            # a1 and a2: team-b's and team-c's jobs stay invisible
            assert page.locator("#jobs tbody tr").count() == 2
            page.wait_for_selector("#detail-note:not([hidden])")
            assert "did not answer" in page.text_content("#detail-note")
            assert point_steps(page, "reward") == []
            assert page.is_visible("#chart-reward .no-data")
        api.close()


def test_samples_are_listed_newest_first_as_text(page, finished_run: str, tmp_path) -> None:
    """samples.jsonl of a finished run: one row per sample, newest step first, and completions
    that look like HTML (a `<script>` included) stay text."""
    run_dir = tmp_path  # finished_run's files
    append_samples(run_dir, [
        {"step": s, "prompt": f"What is {s}+{i}?", "completion": f"<b>{s + i}</b>",
         "reward": float(i), "advantage": i - 0.5, "finish_reason": "stop"}
        for s in (4, 8) for i in range(2)
    ])  # fmt: skip
    evil = "<script>window.pwned = 1</script><img src=x onerror='window.pwned = 2'>"
    append_samples(run_dir, [{"step": 9, "prompt": "p", "completion": evil, "reward": 0.0,
                              "advantage": 0.0, "finish_reason": "length"}])  # fmt: skip
    page.goto(f"{finished_run}/?job=local/quickstart")
    page.wait_for_selector("#samples-block:not([hidden]) #samples tbody tr")
    rows = page.eval_on_selector_all(
        "#samples tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))"
    )
    assert [r[0] for r in rows] == ["9", "8", "8", "4", "4"]
    assert rows[0][5] == evil and rows[0][3] == "length"
    assert rows[1][4:] == ["What is 8+1?", "<b>9</b>"] and rows[1][3] == "stop"
    assert page.locator("#samples b, #samples script, #samples img").count() == 0
    assert page.evaluate("window.pwned") is None


@pytest.fixture
def ppo_and_grpo_runs(tmp_path):
    """`ppo` (value loss 1/step, explained variance 0.1*step - 0.5) and `grpo` (no critic)."""
    ppo, grpo = tmp_path / "ppo", tmp_path / "grpo"
    write_run(ppo, steps=OTHER_STEPS)
    history = run_files.read_history(ppo)
    for r in history:
        r.value_loss, r.explained_variance = 1.0 / r.step, 0.1 * r.step - 0.5
    run_files.write_history(ppo, history)
    write_run(grpo, steps=OTHER_STEPS)
    store = LocalStore()
    store.add_finished(make_job("ppo"), ppo)
    store.add_finished(make_job("grpo"), grpo)
    with live_server(create_app(store)) as url:
        yield url


def test_the_episodes_chart_is_shown_only_for_multi_turn_runs(page, tmp_path) -> None:
    agent, single = tmp_path / "agent", tmp_path / "single"
    write_run(agent, steps=OTHER_STEPS)
    history = run_files.read_history(agent)
    for r in history:
        r.turns_mean, r.tool_calls, r.tool_errors = 1.5, float(2 * r.step), 1.0
    run_files.write_history(agent, history)
    write_run(single, steps=OTHER_STEPS)
    store = LocalStore()
    store.add_finished(make_job("agent"), agent)
    store.add_finished(make_job("single"), single)
    with live_server(create_app(store)) as url:
        page.goto(f"{url}/?job=local/single")
        wait_for_step(page, "reward", OTHER_STEPS)
        assert page.is_hidden("#chart-episodes")
        page.goto(f"{url}/?job=local/agent")
        wait_for_step(page, "episodes", OTHER_STEPS)
        assert page.is_visible("#chart-episodes")
        assert page.evaluate("lorarlCharts.episodes.series.map(s => s.scale)") == [
            "x", "y", "y2", "y2"]  # fmt: skip
        hover(page, "episodes", 3)
        assert legend(page, "episodes") == [
            ("step", "3"), ("agent turns per episode", "1.5"), ("agent tool calls", "6"),
            ("agent tool errors", "1")]  # fmt: skip


def test_the_critic_chart_is_shown_only_for_runs_with_a_critic(page, ppo_and_grpo_runs) -> None:
    page.goto(f"{ppo_and_grpo_runs}/?job=local/grpo")
    wait_for_step(page, "reward", OTHER_STEPS)
    assert page.is_hidden("#chart-critic")
    assert page.evaluate("'critic' in lorarlCharts") is False
    page.goto(f"{ppo_and_grpo_runs}/?job=local/ppo")
    wait_for_step(page, "critic", OTHER_STEPS)
    assert page.is_visible("#chart-critic")
    every = list(range(1, OTHER_STEPS + 1))
    assert point_steps(page, "critic", 1) == every  # value loss
    assert point_steps(page, "critic", 2) == every  # explained variance, on the right axis
    assert page.evaluate("lorarlCharts.critic.series.map(s => s.scale)") == ["x", "y", "y2"]
    assert page.evaluate("lorarlCharts.critic.axes.map(a => a.label)") == [
        "step", "value loss", "explained variance"]  # fmt: skip
    hover(page, "critic", 4)
    assert legend(page, "critic") == [
        ("step", "4"), ("ppo value loss", "0.25"), ("ppo explained variance", "-0.1")]  # fmt: skip
    # plotted with a run without a critic: the chart stays, that run adds only gaps
    page.goto(f"{ppo_and_grpo_runs}/?job=local/ppo&plot=local/grpo")
    page.wait_for_function("() => lorarlCharts.critic && lorarlCharts.critic.series.length === 5")
    assert page.is_visible("#chart-critic")
