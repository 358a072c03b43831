"""Run a function on a real gloo process group of N CPU processes, with a hard timeout; run a
``shardgraph`` command in this process, its workers forked from the same server."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


#: Imported once by the fork server, which forks every rank: a spawned rank imports torch and
#: transformers itself (four ranks on two cores: 20-30 s before a tiny Llama exists; forked from
#: the server: under a second).
PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
    "torch._dynamo", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
    "shardgraph", "tests.models",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, out: str, fn, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # the rendezvous is a file of this run's own directory: a port picked ahead of the ranks'
    # start could be taken by another process meanwhile (a spawned rank binds it seconds later)
    dist.init_process_group(
        "gloo", init_method=f"file://{Path(out) / 'store'}", rank=rank, world_size=world_size
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
        dist.barrier()
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            # gloo aborts at exit now and then unless the group is torn down first
            dist.destroy_process_group()
        time.sleep(0.3)


def run(fn, world_size: int, *args, timeout: float = 240.0,
        start_method: str = "forkserver") -> list:
    """``fn(rank, world_size, *args)`` on every rank; returns each rank's result.

    A failing rank makes the others be terminated (no hang); the error text of every failed
    rank is raised here. ``fn`` must be importable (module level).

    Ranks are forked from one fork server per test session, started on first use, that has
    only imported ``PRELOAD``: no torch thread pool, process group or model exists there to be
    forked. A rank gets this process's ``sys.path`` and working directory but the server's
    environment: a test that sets variables a rank must read at start-up (glibc's ``MALLOC_*``)
    passes ``start_method="spawn"``.
    """
    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(
            _worker, args=(world_size, out, fn, args), nprocs=world_size,
            join=False, start_method=start_method,
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world_size} ranks exceeded {timeout}s")
        except Exception as exc:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            errors = sorted(Path(out).glob("rank*.err"))
            detail = "\n".join(f"--- {e.stem} ---\n{e.read_text()}" for e in errors)
            raise RuntimeError(f"{exc}\n{detail}") from None
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def command(*args, timeout: float = 240.0, env: dict[str, str] | None = None) -> int:
    """``shardgraph ARGS`` in this process, as the command line runs it (its exit code), with
    ``env`` added to the environment its workers take, within ``timeout`` seconds: past it a
    ``TimeoutError`` ends the launch, whose agent stops every worker as it does on any error.
    A test that expects a refusal runs it here too: a regression that launched would end at the
    timeout, not hang the suite.

    The workers fork from this session's fork server, whose imports every launch shares: a
    ``python -m shardgraph.train`` of its own imports torch and transformers in the launcher and
    again in its server, ~20 s of CPU before a tiny model's first step on two cores. What the
    workers print goes to the server's output, not to this process's: tests read the metrics
    file, and the entry point's own output is tested by runs of the command line
    (tests/test_readme.py, tests/test_failwell.py)."""
    from shardgraph.cli import main

    def expire(signum, frame):
        raise TimeoutError(f"shardgraph {' '.join(map(str, args))} exceeded {timeout}s")

    before = signal.signal(signal.SIGALRM, expire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, timeout)
    began = time.monotonic()
    try:
        with _environ(env or {}):
            return main([str(a) for a in args])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
        if outer:  # an alarm set around this call (pytest-timeout's) goes on, not off
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - began), 1e-3))


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
