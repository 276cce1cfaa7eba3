"""Every complete LoRARLJob manifest shown in the README and docs/ validates as a cluster job.

A reader copies these; one that `lorarl validate` (and so the webhook) refuses is a trap (issue
37). Fragments (a `spec` section on its own) are not manifests and are left to their own tests.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from lorarl.api.validation import check_manifest

ROOT = Path(__file__).resolve().parents[3]
DOCS = [
    ROOT / "README.md",
    ROOT / "charts" / "lorarl" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
BLOCK = re.compile(r"^```ya?ml\n(.*?)^```", re.M | re.S)


def manifests() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for match in BLOCK.finditer(text):
            body = match.group(1)
            if re.search(r"^kind:\s*LoRARLJob\b", body, re.M):
                line = text.count("\n", 0, match.start()) + 1
                found.append((f"{doc.relative_to(ROOT)}:{line}", body))
    return found


def test_the_docs_show_manifests() -> None:
    assert any(where.startswith("README.md:") for where, _ in manifests())


@pytest.mark.parametrize(("where", "body"), manifests(), ids=[w for w, _ in manifests()])
def test_every_manifest_in_the_docs_validates(where: str, body: str) -> None:
    problems = check_manifest(yaml.safe_load(body), cluster=True)
    assert not problems, f"{where}: " + "; ".join(str(p) for p in problems)
