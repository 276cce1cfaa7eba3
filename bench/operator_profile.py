"""Where the operator's CPU goes under a benchmark: cProfile of the operator process.

    python -m bench.operator_profile [scale|steady] [--top 25] [benchmark args, e.g. --jobs 200]

Runs `bench.operator_scale` (or `bench.operator_steady`) with the operator under cProfile,
results to a scratch file (the figures of a profiled run are several times slower and are not
the benchmark's), then prints the top entries by own time and by cumulative time. The stats stay
in /tmp/lorarl-operator-<bench>.prof for `python -m pstats`.
"""

from __future__ import annotations

import argparse
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("bench", nargs="?", choices=("scale", "steady"), default="scale")
    parser.add_argument("--top", type=int, default=25)
    args, rest = parser.parse_known_args()  # the rest goes to the benchmark
    prof = Path(tempfile.gettempdir()) / f"lorarl-operator-{args.bench}.prof"
    out = Path(tempfile.gettempdir()) / f"lorarl-operator-{args.bench}-profiled.json"
    extra = [a for a in rest if a != "--"]
    cmd = [sys.executable, "-m", f"bench.operator_{args.bench}", "--profile", str(prof)]
    subprocess.run([*cmd, "--out", str(out), *extra], check=True, stdout=subprocess.DEVNULL)
    stats = pstats.Stats(str(prof))
    for key in ("tottime", "cumtime"):
        print(f"== top {args.top} by {key} ({prof})")
        stats.sort_stats(key).print_stats(args.top)


if __name__ == "__main__":
    main()
