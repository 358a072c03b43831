"""How fast the command line starts: wall time of ``shardgraph plan``, ``explain``, ``plugins``
and ``estimate``.

Each command runs ``--repeat`` times as a fresh process (``python -m shardgraph.cli ...``), next
to a bare ``python -c pass`` for the interpreter's own start; prints the best and median wall
time of each, and whether torch or transformers was imported (they must not be: the target is
under 0.5 s wall). ``--importtime`` also prints the slowest imports of ``plan``
(``python -X importtime``), to find what to make lazy.

    python bench/cli_startup.py [--repeat 10] [--importtime]

The best of several runs is the figure to quote: on a shared machine the others measure load.
Bytecode is cached (in a temporary prefix) as it is after an install; ``--no-bytecode``
measures a start that compiles every module (``PYTHONDONTWRITEBYTECODE=1``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = str(ROOT / "examples" / "default.toml")
COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "plan": ["-m", "shardgraph.cli", "plan", PIPELINE, "--world-size", "4"],
    "plan --json": ["-m", "shardgraph.cli", "plan", PIPELINE, "--world-size", "4", "--json"],
    "explain": ["-m", "shardgraph.cli", "explain", PIPELINE, "--world-size", "4"],
    "plugins": ["-m", "shardgraph.cli", "plugins"],
    "estimate": ["-m", "shardgraph.cli", "estimate", str(ROOT / "examples" /
                 "llama3_70b_dryrun.toml"), "--world-size", "1024"],
}
ARGS = argparse.Namespace(no_bytecode=False)
PROBE = ("import runpy, sys; sys.argv = ['shardgraph'] + sys.argv[1:]; "
         "rc = 0\ntry: runpy.run_module('shardgraph.cli', run_name='__main__')\n"
         "except SystemExit as e: rc = e.code or 0\n"
         "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules), "
         "file=sys.stderr)")


_CACHE = tempfile.mkdtemp(prefix="shardgraph-pycache-")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if not ARGS.no_bytecode:
        # Compiled bytecode cached, as after an install (PYTHONDONTWRITEBYTECODE would make
        # every start compile every module again); kept out of the tree in a temp prefix.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = _CACHE
    return env


def _time(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env=_env(), cwd=ROOT)
    return time.perf_counter() - start


def _heavy(args: list[str]) -> str:
    if args[:2] != ["-m", "shardgraph.cli"]:
        return ""
    done = subprocess.run([sys.executable, "-c", PROBE, *args[2:]], capture_output=True,
                          text=True, env=_env(), cwd=ROOT)
    return done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "?"


def _importtime(args: list[str], top: int = 12) -> list[str]:
    done = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True,
                          text=True, env=_env(), cwd=ROOT)
    rows = []
    for line in done.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), parts[2].rstrip()))
    return [f"{us / 1000:8.1f} ms  {name}" for us, name in sorted(rows, reverse=True)[:top]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--importtime", action="store_true")
    p.add_argument("--no-bytecode", action="store_true",
                   help="compile every module at every start (PYTHONDONTWRITEBYTECODE's cost)")
    global ARGS
    args = ARGS = p.parse_args()
    for cmd in COMMANDS.values():  # one warm-up run each: bytecode written, caches filled
        _time(cmd)
    print(f"{'command':<16} {'best':>8} {'median':>8}  imported")
    for name, cmd in COMMANDS.items():
        times = [_time(cmd) for _ in range(args.repeat)]
        print(f"{name:<16} {min(times):7.3f}s {statistics.median(times):7.3f}s  {_heavy(cmd)}")
    if args.importtime:
        print("\nslowest imports of `plan` (cumulative):")
        print("\n".join(_importtime(COMMANDS["plan"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
