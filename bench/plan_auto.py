"""How fast ``plan --auto`` searches: CPU time of ``shardgraph.autoplan`` on Llama-3-70B
(``examples/llama3_70b_dryrun.toml``) at 4096 GPUs, the README's example, in fresh processes.

Each round times this checkout and, with ``--base DIR`` (another checkout or a worktree, e.g.
``git worktree add /tmp/base HEAD~3``), that one, one after the other so that both see the same
load; prints the best and median of each, their ratio, and the plans each search counted (the
same model and the same rules give the same counts; different counts say the search changed).

    python bench/plan_auto.py [--rounds 5] [--world-size 4096] [--base DIR]

The best of several rounds is the figure to quote: on a shared machine the others measure load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = str(ROOT / "examples" / "llama3_70b_dryrun.toml")
PROBE = """
import json, sys, time
import shardgraph
from shardgraph.planner.search import autoplan
pipeline = shardgraph.load_pipeline(sys.argv[1])
began = time.process_time()
result = autoplan(pipeline, int(sys.argv[2]))
spent = time.process_time() - began
print(json.dumps({"s": spent, "searched": result["searched"]}))
"""


def one(checkout: Path, world: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, "-c", PROBE, PIPELINE, str(world)], env=env,
                         capture_output=True, text=True, check=True, cwd=checkout)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=4096)
    parser.add_argument("--base", type=Path, help="another checkout to time side by side")
    args = parser.parse_args()
    checkouts = {"this": ROOT, **({"base": args.base.resolve()} if args.base else {})}
    times: dict[str, list[float]] = {k: [] for k in checkouts}
    counts: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name, path in checkouts.items():
            found = one(path, args.world_size)
            times[name].append(found["s"])
            counts[name] = {k: v for k, v in found["searched"].items() if k != "seconds"}
    for name in checkouts:
        best, median = min(times[name]), statistics.median(times[name])
        print(f"{name:5s} best {best:.2f} s  median {median:.2f} s  ({args.rounds} rounds)  "
              f"{counts[name]}")
    if args.base:
        print(f"base / this: {min(times['base']) / min(times['this']):.2f} (best), "
              f"{statistics.median(times['base']) / statistics.median(times['this']):.2f} (median)")


if __name__ == "__main__":
    main()
