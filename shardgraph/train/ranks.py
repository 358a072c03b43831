"""A command on the ranks of a torchrun group, and one report when the group fails.
``launch_ranks`` runs ``shardgraph ARGV`` on N workers of this node (``launch``) and, when they
fail, names the rank whose failure came first and caused the rest, with its own message; each
worker first calls ``worker_setup`` (it dies with our launcher, however that ends) and runs its
command under ``as_rank``, which leaves its error where torchrun's agent finds it
(``TORCHELASTIC_ERROR_FILE``) and exits at once, never waiting in a collective for the others.
``shardgraph train`` and ``shardgraph export`` (``train/cli.py``) run their workers this way.
"""

from __future__ import annotations

import os
import re
import sys
import traceback

from ..core.errors import PlanError


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


#: Set for the workers of ``shardgraph train``'s own launch: they leave reporting to it.
LAUNCHED_ENV = "SHARDGRAPH_LAUNCHED"


def launch_ranks(command: str, nproc: int, forwarded: list[str]) -> int:
    """``shardgraph FORWARDED`` on ``nproc`` workers; one report of a failure, the command's."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .launch import launch

    # the launcher's pid: its workers end with it, however it ends (see _end_with_launcher)
    os.environ[LAUNCHED_ENV] = str(os.getpid())
    # torchrun's agent logs each worker it stops and a failure table: the report below says
    # it in one place (LOGLEVEL, torchrun's own switch, brings its logs back)
    quiet = "LOGLEVEL" not in os.environ
    if quiet:
        logging.disable(logging.ERROR)
    try:
        launch(nproc, forwarded)
    except ChildFailedError as exc:
        return _report_failure(exc.failures, command)
    finally:
        os.environ.pop(LAUNCHED_ENV, None)
        if quiet:
            logging.disable(logging.NOTSET)
    return 0


def worker_setup() -> None:
    """What a rank of a torchrun group (ours, or one started by hand) does first."""
    import signal

    # Ctrl-C: torchrun forwards SIGINT to each worker; dying at once and quietly (even inside
    # a collective, where a Python handler would wait) leaves the one report to the launcher.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if os.environ.get(LAUNCHED_ENV, "").isdigit():
        _end_with_launcher(int(os.environ[LAUNCHED_ENV]))


def _end_with_launcher(launcher: int) -> None:
    """Die when ``shardgraph train``'s launcher dies, by whatever signal: SIGKILL (the
    out-of-memory killer's) gives it no chance to stop its workers, which would otherwise
    train on, orphaned. A thread watches the launcher's pid: the parent is the launcher's fork
    server (``launch``), which outlives the launcher while its workers hold it, so a
    parent-death signal would not come. A launcher already gone ends this at once."""
    import signal
    import threading
    import time

    def gone() -> bool:
        try:
            os.kill(launcher, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # it exists
        return False

    def watch() -> None:
        while not gone():
            time.sleep(0.5)
        os._exit(128 + int(signal.SIGKILL))

    if gone():
        os._exit(128 + int(signal.SIGKILL))
    threading.Thread(target=watch, name="shardgraph-launcher-watch", daemon=True).start()


def as_rank(command: str, body) -> int:
    """Run ``body`` on this process, one rank of the torchrun group it belongs to (if any): its
    input error is said once (by rank 0, unless our launcher reports it) and its error is left
    where the launcher finds it; a rank that fails exits at once, never waiting in a
    collective for the others."""
    import time

    import torch
    import torch.distributed as dist

    launched = under_torchrun()
    # our own launcher prints the failing rank's message; under a bare torchrun each prints
    reports = not os.environ.get(LAUNCHED_ENV)
    rank = int(os.environ.get("RANK", 0))
    code, kind = 0, None
    try:
        if launched and not dist.is_initialized():
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
                dist.init_process_group("nccl")
            else:
                dist.init_process_group("gloo")
        body()
    except PlanError as exc:
        _record("plan", str(exc))
        if reports and rank == 0:  # the same input error on every rank: say it once
            print(f"shardgraph {command}: {exc}", file=sys.stderr, flush=True)
        code = 2
    except Exception as exc:
        kind = _record("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        if reports:
            traceback.print_exc()
        code = 1
    if launched:
        sys.stdout.flush()
        sys.stderr.flush()
        if code == 0 and dist.is_initialized():
            # gloo aborts at exit now and then unless the group is torn down first
            dist.barrier()
            dist.destroy_process_group()
            time.sleep(0.5)
        if kind == "peer" and not reports:
            # our launcher's agent reports the first worker it sees end (one a poll, every
            # 0.1 s): a rank that only lost a peer leaves that to the peer, which ended first
            time.sleep(_PEER_GRACE_S)
        from . import launch

        if code or not launch.in_worker:
            os._exit(code)  # a failed rank must not wait in a collective: the agent stops the rest
    return code


#: how long a worker of our launcher whose error only follows from a peer's end waits before
#: it exits (the agent stops it sooner, once it has seen the peer end)
_PEER_GRACE_S = 3.0
#: a worker's error that only follows from another rank's end (a peer gone mid-collective)
_PEER_GONE = re.compile(r"connection (reset|closed|refused)|broken pipe|by peer|"
                        r"DistNetworkError|DistBackendError|timed out", re.IGNORECASE)


def _record(kind: str, text: str, trace: str = "") -> str:
    """Leave this rank's error where torchrun looks for it (``TORCHELASTIC_ERROR_FILE``: its
    failure report shows ``message``), with what our launcher needs to pick the root cause;
    the kind recorded (``"peer"``: an error that only follows from another rank's end)."""
    import json
    import time

    if kind == "error" and _PEER_GONE.search(text):
        kind = "peer"
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return kind
    data = {"message": text, "timestamp": int(time.time()),
            "shardgraph": {"kind": kind, "text": text, "traceback": trace,
                           "time": time.time()}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the exit code still tells the launcher this rank failed
    return kind


def _report_failure(failures: dict, command: str = "train") -> int:
    """One report for a failed group: the rank whose failure came first and caused the rest,
    with its own message. torchrun lists every rank that ended, including those it stopped
    itself (with SIGTERM) and those that only lost a peer."""
    import signal

    def rank_of(item):
        order, (rank, failure) = item
        data = failure.error_file_data
        rec = data.get("shardgraph") if isinstance(data, dict) else None
        if rec is None and failure.exitcode < 0 and failure.exitcode != -signal.SIGTERM:
            cls = 0  # killed from outside (SIGKILL: often the out-of-memory killer)
        elif rec is not None and rec["kind"] != "peer":
            cls = 1  # its own error
        elif failure.exitcode < 0:
            cls = 2  # SIGTERM: from outside, or torchrun stopping it after another's failure
        elif rec is not None:
            cls = 3  # it lost a peer
        else:
            cls = 4
        return (cls, rec["time"] if rec is not None else order, order)

    ranked = sorted(enumerate(failures.items()), key=rank_of)
    _, (rank, failure) = ranked[0]
    data = failure.error_file_data
    rec = data.get("shardgraph") if isinstance(data, dict) else None
    rest = "; the other workers were stopped"
    if rec is None:
        if failure.exitcode < 0:
            name = failure.signal_name()
            why = " (the out-of-memory killer sends it too)" if name == "SIGKILL" else ""
            print(f"shardgraph {command}: rank {rank} was killed by {name} (signal "
                  f"{-failure.exitcode}){why}{rest}", file=sys.stderr, flush=True)
            return 1
        print(f"shardgraph {command}: rank {rank} exited with code {failure.exitcode} without a "
              f"message{rest}", file=sys.stderr, flush=True)
        return failure.exitcode or 1
    if rec["kind"] == "plan":
        print(f"shardgraph {command}: rank {rank}: {rec['text']}", file=sys.stderr, flush=True)
        return 2
    if rec.get("traceback"):
        print(f"rank {rank}: {rec['traceback'].rstrip()}", file=sys.stderr)
    print(f"shardgraph {command}: rank {rank} failed: {rec['text']}{rest}", file=sys.stderr,
          flush=True)
    return 1
