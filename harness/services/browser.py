"""Headless Chromium for dashboard tests: Debian's chromium driven by Playwright for Python
(Playwright's own browser download is never used)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOT = Path(__file__).resolve().parents[2] / "bench" / "results" / "dashboard.png"
# The README's picture is refreshed from a real run only when asked (LORARL_README_PICTURE=1):
# a test run leaves the tracked file alone.
REFRESH_README_PICTURE = os.environ.get("LORARL_README_PICTURE") == "1"


def point_steps(page, chart: str, series: int = 1) -> list[int]:
    """The steps at which one series of a dashboard chart (`reward`, `kl`, ...) has a value: what
    the page handed to uPlot (window.lorarlCharts); 1 is the first run's first series."""
    return page.evaluate(
        """([chart, i]) => { const d = window.lorarlCharts[chart].data;
            return d[0].filter((_, j) => typeof d[i][j] === "number"); }""",
        [chart, series],
    )


def wait_for_step(page, chart: str, step: int, timeout: float = 10_000) -> None:
    """Until the chart's first series has a value at `step`."""
    page.wait_for_function(
        """([chart, step]) => { const u = (window.lorarlCharts || {})[chart];
            return u && u.data.length > 1
              && typeof u.data[1][u.data[0].indexOf(step)] === "number"; }""",
        arg=[chart, step],
        timeout=timeout,
    )
