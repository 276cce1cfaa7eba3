"""Headless Chromium for dashboard tests: Debian's chromium driven by Playwright for Python
(Playwright's own browser download is never used)."""

from __future__ import annotations

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


def point_steps(page, chart: str) -> list[int]:
    """The step numbers of the points drawn in one chart."""
    return [
        int(s)
        for s in page.eval_on_selector_all(
            f"#{chart} circle[data-step]", "els => els.map(e => e.dataset.step)"
        )
    ]
