"""A Dockerfile read as its stages: what the image tests check (tests/unit/plan/test_images.py) and
what the process kubelet builds an image's environment from (images.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, args = line.partition(" ")
        out.append((keyword.upper(), args.strip()))
    assert not pending, "dangling line continuation"
    return out


def stages(text: str) -> list[Stage]:
    found: list[Stage] = []
    for keyword, args in instructions(text):
        if keyword == "FROM":
            parts = [p for p in args.split() if not p.startswith("--")]
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            found.append(Stage(base=parts[0], name=name))
        else:
            assert found, f"{keyword} before the first FROM"
            found[-1].instructions.append((keyword, args))
    return found
