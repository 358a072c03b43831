"""Run test files N times and count each test's failures: a test that fails at random shows here.

    python3 bench/flaky.py tests/test_failwell.py tests/test_train_e2e.py --rounds 5 --load 1

Rounds run back to back; ``--load K`` runs the last K rounds two at a time (each pair shares the
machine, as a busy CI would). Each round is one pytest run with its own JUnit XML report; the
table lists every test that did not pass in every round, with how often it failed or erred. Exit
status 1 when any did.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def _start(files: list[str], report: Path, extra: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
         *extra, *files], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """test id -> (passed / failed / error / skipped, the failure's first line), from one JUnit
    report."""
    if not report.exists():
        return {"<pytest did not write a report>": ("error", "")}
    found = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag: child for child in case}
        kind = next((k for k in ("failure", "error", "skipped") if k in kinds), None)
        outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(kind, "passed")
        message = kinds[kind].get("message", "") if kind in ("failure", "error") else ""
        found[name] = (outcome, message.strip().splitlines()[0][:140] if message.strip() else "")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--load", type=int, default=0,
                        help="run the last LOAD rounds two at a time (adds load)")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    args = parser.parse_args(argv)
    extra = args.pytest_args.split()
    quiet = args.rounds - args.load
    batches = [[i] for i in range(quiet)] + [
        [i, i + 1] for i in range(quiet, args.rounds, 2)]
    bad: Counter = Counter()
    seen: Counter = Counter()
    why: dict[str, str] = {}  # test -> the first failure's message
    with tempfile.TemporaryDirectory() as tmp:
        for batch in batches:
            batch = [i for i in batch if i < args.rounds]
            started = time.monotonic()
            procs = [(i, _start(args.files, Path(tmp, f"r{i}.xml"), extra)) for i in batch]
            for i, proc in procs:
                proc.wait()
                outcomes = _outcomes(Path(tmp, f"r{i}.xml"))
                seen.update(outcomes.keys())
                failed = [t for t, (o, _) in outcomes.items() if o in ("failed", "error")]
                bad.update(failed)
                for t in failed:
                    why.setdefault(t, f"round {i + 1}: {outcomes[t][1]}")
                print(f"round {i + 1}{' (under load)' if len(batch) > 1 else ''}: "
                      f"{len(outcomes) - len(failed)} ok, {len(failed)} failed, "
                      f"{time.monotonic() - started:.0f} s", flush=True)
    print(f"\n{len(seen)} tests, {args.rounds} rounds ({args.load} under load)")
    if not bad:
        print("no test failed in any round")
        return 0
    print(f"{'failures':>8}  test")
    for test, count in bad.most_common():
        print(f"{count:>5}/{seen[test]:<2}  {test}\n          {why[test]}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
