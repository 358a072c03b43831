"""The workers of ``shardgraph train --nproc N`` and ``shardgraph export --nproc N``: torch's
elastic agent on one node (torchrun ``--standalone``'s), each worker forked from a fork server
that has imported torch and transformers once, where N fresh interpreters would each import
them again (~6 s of CPU apiece: most of a short run's start on a small node).

The fork server is Python's (``multiprocessing``'s ``forkserver``): a process of its own,
holding no threads, that forks each worker. Its environment is the launcher's when it started;
each worker takes the launcher's at launch. Where CUDA is available each worker is a fresh
interpreter instead (``spawn``): the imports ask CUDA for its devices, and a child forked after
its parent has initialised CUDA cannot use it.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
import uuid

#: what the fork server imports before it forks: what every worker would import first (the
#: filters of optional libraries' messages first, as the command line installs them)
PRELOAD = ("shardgraph.core.quiet", "torch", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "transformers.modeling_utils", "shardgraph.train.loop")

_started_env: dict[str, str] | None = None  # the environment the fork server started with
#: True in a worker this module forked: it returns its exit code to the agent, which waits for
#: every worker's return (``os._exit(0)`` would leave it waiting)
in_worker = False


def _method() -> str:
    import torch

    return "spawn" if torch.cuda.is_available() else "forkserver"


def start() -> None:
    """Start the fork server once per process, so that its imports run beside the launcher's
    own checks (nothing where CUDA is available). One thread per worker (N workers share the
    cores; torchrun would warn and set it): ``OMP_NUM_THREADS`` must be set before the server
    imports torch."""
    global _started_env
    if _started_env is not None or _method() != "forkserver":
        return
    from multiprocessing import forkserver

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    forkserver.ensure_running()
    _started_env = dict(os.environ)


def launch(nproc: int, argv: list[str]) -> None:
    """``shardgraph ARGV`` on ``nproc`` workers of this node; torch's ``ChildFailedError``
    (its ``failures``: each failed rank's exit code and error file) when one fails."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    method = _method()
    start()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # what a worker's environment is before the agent sets its rank's: the server's, or this
    # one's (spawn)
    started = _started_env if method == "forkserver" else dict(os.environ)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", run_id=uuid.uuid4().hex, max_restarts=0,
                          start_method=method)
    elastic_launch(config, _worker)(list(argv), dict(os.environ), started)


def _worker(argv: list[str], environ: dict[str, str], started: dict[str, str]) -> int:
    """One rank: the launcher's environment now, under what the agent set for this rank
    (``RANK``, ``MASTER_PORT``, its error file, ...: what differs from ``started``)."""
    global in_worker
    in_worker = True
    agent = {k: v for k, v in os.environ.items() if started.get(k) != v}
    os.environ.clear()
    os.environ.update({**environ, **agent})
    _name(f"shardgraph-r{os.environ['RANK']}")
    # each line as it is written, as torchrun's ``python -u`` workers wrote them
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    # what torchrun's ``python -m shardgraph.train ARGV`` ran in an interpreter of its own (the
    # command's entry, above every layer this module may import)
    sys.argv = ["shardgraph.train", *argv]
    try:
        runpy.run_module("shardgraph.train", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)  # as an interpreter ending on it prints it: code 1
        return 1
    return 0


def _name(name: str) -> None:
    """This process's name as ``ps``, ``top`` and /proc/PID/comm show it (Linux: 15 bytes; a
    forked worker would otherwise show its fork server's command line, the same for every
    rank)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_name = 15
        ctypes.CDLL(None).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)
