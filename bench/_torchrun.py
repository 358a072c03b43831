"""Launch a bench script under torchrun with its own options (shared by the multi-process ones).

Run as ``python bench/x.py --nproc 2 ...``: without ``RANK`` in the environment the script
relaunches itself under torchrun; its options travel by environment, since torchrun's own parser
would claim ``--nproc``. Inside a rank, :func:`argv` gives them back to ``argparse``.
"""

from __future__ import annotations

import os
import sys

_ENV = "SHARDGRAPH_BENCH_ARGS"


def argv() -> list[str] | None:
    """The script's options: the launcher's command line, inside a rank; None (sys.argv) else."""
    got = os.environ.get(_ENV)
    return got.split("\x1f") if got else None


def launch(script: str, nproc: int) -> int:
    from torch.distributed.run import main as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[_ENV] = "\x1f".join(sys.argv[1:])
    torchrun(["--standalone", f"--nproc-per-node={nproc}", os.path.abspath(script)])
    return 0
