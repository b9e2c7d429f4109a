"""How long ranged runs take: the default scenario ranged, a ranged `advise`, and one point of each for scale.

    python tools/bench_ranges.py [--rounds N]

Prints, per command, the wall seconds of each round and their best, with the runs' count where the command says
it. A benchmark that prints figures (docs/benchmarks.md), not a test: nothing here fails on time."""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
TREE = ROOT / "tests/data/inspect/edited/vtd-metal-strict.tar.gz"
COMMANDS = [
    ("run (6 runs, one point)", ["run"]),
    ("run --ranges (6 runs, 24 samples each)", ["run", "--ranges"]),
    ("advise --no-ranges (3 options x 3 seeds)", ["advise", "--root", str(TREE), "--no-ranges"]),
    ("advise (3 options, 24 samples each)", ["advise", "--root", str(TREE)]),
    ("run nvme --ranges", ["run", "nvme", "--ranges"]),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    print(f"{os.cpu_count()} CPUs; best of {a.rounds}")
    for name, args in COMMANDS:
        times = []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "iommulab", *args, "--no-progress"] if args[0] == "run" else
                           [sys.executable, "-m", "iommulab", *args], check=True, stdout=subprocess.DEVNULL)
            times.append(time.perf_counter() - t0)
        print(f"{name:<44} {min(times):6.1f} s   (rounds: {', '.join(f'{t:.1f}' for t in times)})")


if __name__ == "__main__":
    main()
