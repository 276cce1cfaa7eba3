"""Copy the generated CRDs from crds/ into the Helm chart and the kustomize base.

Helm only installs CRDs from the chart's own crds/ folder, and kustomize refuses files outside
its root, so both need a byte-identical copy of what `lorarl crds` generated.
Usage: python scripts/sync_chart_crds.py [--check]   (--check: exit 1 when a copy is stale)
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "crds"
COPIES = (ROOT / "charts" / "lorarl" / "crds", ROOT / "operator" / "config" / "crd" / "bases")


def stale_copies(source: Path = SOURCE, copies: tuple[Path, ...] = COPIES) -> list[str]:
    """Every copy that is missing, different, or no longer generated."""
    wanted = {p.name: p.read_bytes() for p in sorted(source.glob("*.yaml"))}
    problems = []
    for folder in copies:
        present = {p.name: p.read_bytes() for p in folder.glob("*.yaml")} if folder.is_dir() else {}
        for name, data in wanted.items():
            if present.get(name) != data:
                problems.append(f"{folder / name}: differs from {source / name}")
        problems += [f"{folder / n}: not in {source}" for n in sorted(set(present) - set(wanted))]
    return problems


def sync(source: Path = SOURCE, copies: tuple[Path, ...] = COPIES) -> None:
    """Make every copy folder hold exactly the generated CRDs."""
    names = {p.name for p in source.glob("*.yaml")}
    for folder in copies:
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.yaml"):
            if old.name not in names:
                old.unlink()
        for name in sorted(names):
            shutil.copyfile(source / name, folder / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale copies")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale_copies()
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("run: python scripts/sync_chart_crds.py", file=sys.stderr)
        return 1 if problems else 0
    sync()
    return 0


if __name__ == "__main__":
    sys.exit(main())
