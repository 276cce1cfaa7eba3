"""The README's algorithm table is true: every algorithm the API accepts has a row, and every test
a row names exists (file, and the test function when one is named)."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from lorarl.api.spec.algorithm import Algorithm

ROOT = Path(__file__).resolve().parents[3]


def table_rows() -> dict[str, list[str]]:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("\n### Algorithms\n")
    section = readme[start : readme.index("\n#", start + 1)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = re.match(r"`(\w+)`", cells[0]) if len(cells) == 3 else None
        if name:
            rows[name.group(1)] = re.findall(r"`(tests/[^`]+)`", cells[2])
    return rows


def test_every_algorithm_has_a_row_with_tests_that_exist():
    rows = table_rows()
    assert set(rows) == set(typing.get_args(Algorithm))
    for name, tests in rows.items():
        assert tests, f"{name}: no test named"
        for ref in tests:
            path, _, func = ref.partition("::")
            source = (ROOT / path).read_text()  # raises if the file is gone
            assert not func or re.search(rf"^def {func}\(", source, re.M), f"{name}: {ref}"
