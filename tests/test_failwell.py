"""``shardgraph train`` failing well: every input problem refused before launch, a worker's end
reported naming its rank, signals, damaged / incomplete / foreign checkpoints and failed saves.

The launch tests run the real launcher (``python -m shardgraph.train train --nproc 2``) in a
subprocess with hard timeouts and send real signals to it or to one of its workers (found by
its ``RANK`` in ``/proc``). The checkpoint tests train a tiny Llama in this process (world 1):
what they check (settings, shard files, saving) does not depend on the world size, and the
crash-during-save test of test_train_e2e covers the multi-process save.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shardgraph.cli import main
from shardgraph.core.errors import PlanError
from shardgraph.train import checkpoint as ckpt
from shardgraph.train.save import SaveFailed
from shardgraph.train import loads_pipeline, train
from shardgraph.train.preflight import checkpoint_dir
from tests import _dist

PIPELINE = """
[model.config]
vocab_size = 128
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 1
num_attention_heads = 4
num_key_value_heads = 2
{config}
[data]
seq_len = {seq_len}
[train]
steps = {steps}
global_batch_size = 4
optimizer = "sgd"
lr = 0.01
{train}
[checkpoint]
dir = "{dir}"
every = 2
{checkpoint}
{plugins}
"""


def pipeline_text(dir: Path, steps: int = 4, *, config: str = "", train: str = "",
                  checkpoint: str = "", plugins: str = "[plugins.fsdp2]", seq_len: int = 8) -> str:
    return PIPELINE.format(dir=dir, steps=steps, config=config, train=train,
                           checkpoint=checkpoint, plugins=plugins, seq_len=seq_len)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -- before launch --------------------------------------------------------------------------

def test_unknown_model_config_keys_are_refused_with_did_you_mean(tmp_path, capsys):
    text = pipeline_text(tmp_path / "ck", config="hiden_size = 48\nrope_theta = 50000.0")
    assert _dist.command("train", str(write(tmp_path / "p.toml", text)), "--nproc", "2") == 2
    err = capsys.readouterr().err
    assert "1 problem in [model]" in err  # rope_theta is a key Llama's config takes up
    assert "model.config.hiden_size" in err and "did you mean 'hidden_size'?" in err
    # keys a model reads without its config class declaring them are not refused
    moe = loads_pipeline('[model]\narchitecture = "Qwen3MoeForCausalLM"\n[model.config]\n'
                         "num_experts = 4\nhead_dim = 16\nmoe_intermediate_size = 32")
    from shardgraph.train.model import hf_config

    assert hf_config(moe.model).head_dim == 16


def test_every_problem_is_reported_before_launch(tmp_path, capsys):
    """A model check of the plan (tp must divide the heads), an unwritable checkpoint dir, an
    export dir that the end of the run would refuse, a section rule: one error, no launch."""
    in_the_way = write(tmp_path / "a_file", "x")
    export = tmp_path / "export"
    export.mkdir()
    (export / "old").write_text("x")
    text = pipeline_text(in_the_way / "ck", checkpoint=f'export_hf = "{export}"',
                         plugins="[plugins.tp]\nsize = 2",
                         config="").replace("num_attention_heads = 4", "num_attention_heads = 3"
                                            ).replace("num_key_value_heads = 2",
                                                      "num_key_value_heads = 3")
    text = text.replace("hidden_size = 32", "hidden_size = 48")
    began = time.monotonic()
    assert _dist.command("train", str(write(tmp_path / "p.toml", text)), "--nproc", "2") == 2
    took = time.monotonic() - began
    err = capsys.readouterr().err
    assert "num_attention_heads = 3 is not divisible by tp = 2" in err
    assert f"{in_the_way} is a file, not a directory" in err
    assert "checkpoint.export_hf" in err and "not empty" in err
    assert took < 60, took  # no process group was started and waited for
    text = pipeline_text(tmp_path / "ck").replace('[model.config]',
                                                  '[model]\narchitecture = "NoSuchForCausalLM"'
                                                  '\n[model.config]')
    assert _dist.command("train", str(write(tmp_path / "q.toml", text)), "--nproc", "2") == 2
    err = capsys.readouterr().err
    assert "'NoSuchForCausalLM' is not an HF model class" in err and "in [model]" in err
    text = pipeline_text(tmp_path / "ck", train="log_every = 0")
    assert _dist.command("train", str(write(tmp_path / "r.toml", text))) == 2
    assert "in [train]:" in capsys.readouterr().err  # not "in the parallelism plan"


def test_a_full_or_unwritable_checkpoint_dir_is_refused_before_launch(tmp_path):
    pipeline = loads_pipeline(pipeline_text(tmp_path / "ck"))
    assert checkpoint_dir(pipeline, 1000) == []
    [full] = checkpoint_dir(pipeline, 2**62)  # 4 EiB of parameters: no disk has room
    assert full.keys == ("checkpoint.dir",) and "free" in full.message
    assert "point [checkpoint] dir at a writable directory" in full.hint
    blocked = write(tmp_path / "blocked", "")
    [bad] = checkpoint_dir(loads_pipeline(pipeline_text(blocked / "ck")), 1000)
    assert "is a file, not a directory" in bad.message
    if os.geteuid() != 0:  # root writes through permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        [bad] = checkpoint_dir(loads_pipeline(pipeline_text(locked / "ck")), 1000)
        assert "not writable" in bad.message


# -- checkpoints ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """4 steps of the tiny model in this process, checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("failwell")
    root = tmp / "ck"
    rows = train(loads_pipeline(pipeline_text(root, steps=6)))["rows"]
    reference = [r["loss"] for r in rows]
    shutil.rmtree(root)
    train(loads_pipeline(pipeline_text(root, steps=4)))
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000002", "step_00000004"]
    return tmp, root, reference


def test_resume_under_other_settings_is_refused_naming_each_key(saved, tmp_path, capsys):
    _, root, _ = saved
    changed = pipeline_text(root, steps=6, config="rope_theta = 50000.0", seq_len=16,
                            train='optimizer = "adamw"').replace("[data]",
                                                                 '[model]\ndtype = "bf16"\n[data]')
    changed = changed.replace('optimizer = "sgd"\n', "")
    before = sorted(p.name for p in root.iterdir())
    assert _dist.command("train", str(write(tmp_path / "p.toml", changed)), "--nproc", "2") == 2
    err = capsys.readouterr().err
    assert "step_00000004 was saved from another model" in err
    assert "model.dtype = 'fp32' in the checkpoint, 'bf16' now" in err
    assert "data.seq_len = 8 in the checkpoint, 16 now" in err
    assert "train.optimizer = 'sgd' in the checkpoint, 'adamw' now" in err
    assert "model.config.rope_parameters" in err and "50000.0" in err
    assert "new directory" in err  # how to start fresh
    assert sorted(p.name for p in root.iterdir()) == before


def test_incomplete_dir_is_replaced_and_a_new_lr_announced(saved, capsys):
    tmp, root, reference = saved
    work = tmp / "incomplete"
    shutil.copytree(root, work)
    (work / "step_00000006").mkdir()  # a save that never wrote .metadata or meta.json
    (work / "step_00000006" / "__0_0.distcp").write_text("partial")
    out = train(loads_pipeline(pipeline_text(work, steps=6)))
    assert [r["step"] for r in out["rows"]] == [5, 6]
    assert [r["loss"] for r in out["rows"]] == pytest.approx(reference[4:6], abs=1e-6)
    assert ckpt.latest(work).name == "step_00000006" and ckpt.is_complete(work / "step_00000006")
    assert ckpt.read_meta(work / "step_00000006")["step"] == 6
    capsys.readouterr()
    train(loads_pipeline(pipeline_text(work, steps=8, train="lr = 0.02").replace(
        "lr = 0.01\n", "")))
    assert "resumed from" in (out := capsys.readouterr().out) and "train.lr 0.01 -> 0.02" in out


def losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def test_damaged_checkpoint_names_itself_and_the_previous_one(saved, tmp_path, capsys):
    """Sizes are checked before launch; bytes when a resume reads them (checksums of the
    manifest). The advice resumes for one run (``--resume``): the file keeps resume = "auto",
    which goes on working once ``keep`` has deleted that checkpoint."""
    tmp, root, reference = saved
    work = tmp / "damaged"
    shutil.copytree(root, work)
    manifest = json.loads((work / "step_00000004" / ckpt.META).read_text())["files"]
    assert sorted(manifest) == [".metadata", "__0_0.distcp"]
    assert all(len(f[ckpt.CHECKSUM]) == 16 and f["bytes"] > 0 for f in manifest.values())
    shard = sorted((work / "step_00000004").glob("*.distcp"))[0]
    os.truncate(shard, shard.stat().st_size // 2)
    path = write(tmp_path / "p.toml", pipeline_text(work, steps=6))
    assert _dist.command("train", str(path), "--nproc", "2") == 2
    err = capsys.readouterr().err
    assert f"checkpoint {work / 'step_00000004'} is damaged" in err and "truncated" in err
    assert f"shardgraph train {path} --resume {work / 'step_00000002'}" in err
    # followed for one run: step 4 is saved again over the damaged one
    assert main(["train", str(path), "--nproc", "1", "--resume", str(work / "step_00000002"),
                 "--metrics", str(tmp_path / "m.jsonl")]) == 0
    assert losses(tmp_path / "m.jsonl") == pytest.approx(reference[2:6], abs=1e-6)
    assert [p.name for p in ckpt.complete_checkpoints(work)] == ["step_00000004",
                                                                 "step_00000006"]
    ckpt.check_intact(work / "step_00000004")
    # damage of the right length: 64 bytes zeroed mid-file, found by the checksum
    good = tmp / "good6"
    shutil.copytree(work / "step_00000006", good)
    shard = sorted((work / "step_00000006").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(b"\0" * 64)
    with pytest.raises(PlanError, match=f"{shard.name} does not match its checksum") as info:
        train(loads_pipeline(pipeline_text(work, steps=8)))
    [v] = info.value.violations
    assert f"checkpoint {work / 'step_00000006'} is damaged" in v.message
    assert f"--resume {work / 'step_00000004'}" in v.hint
    # .metadata missing beside an intact meta.json and shards: damage, not a skipped save
    shutil.rmtree(work / "step_00000006")
    shutil.copytree(good, work / "step_00000006")
    (work / "step_00000006" / ".metadata").unlink()
    with pytest.raises(PlanError, match=r"its \.metadata .* is missing") as info:
        train(loads_pipeline(pipeline_text(work, steps=8)))
    assert f"--resume {work / 'step_00000004'}" in info.value.violations[0].hint
    # garbage in meta.json names the previous checkpoint too
    shutil.copy(good / ".metadata", work / "step_00000006")
    (work / "step_00000006" / ckpt.META).write_text("{garbage")
    with pytest.raises(PlanError, match=r"meta\.json is unreadable") as info:
        train(loads_pipeline(pipeline_text(work, steps=8)))
    assert f"--resume {work / 'step_00000004'}" in info.value.violations[0].hint
    # the file still resumes by itself ("auto") once the damaged step is repaired
    shutil.copy(good / ckpt.META, work / "step_00000006")
    out = train(loads_pipeline(pipeline_text(work, steps=7)))
    assert [r["step"] for r in out["rows"]] == [7]


def test_torchs_weights_only_advice_never_reaches_the_user(saved):
    """A checkpoint without checksums (saved before the manifest) whose first tensor record
    has a zeroed header: torch's error carries its advice to load with weights_only=False,
    which would run whatever code the file holds; the report keeps only the cause."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    tmp, root, _ = saved
    work = tmp / "pickled"
    shutil.copytree(root, work)
    step = work / "step_00000004"
    meta = json.loads((step / ckpt.META).read_text())
    del meta["files"]
    (step / ckpt.META).write_text(json.dumps(meta))
    index = FileSystemReader(str(step)).read_metadata()
    info = min((info for idx, info in index.storage_data.items()
                if not isinstance(index.state_dict_metadata[idx.fqn], BytesStorageMetadata)),
               key=lambda info: info.offset)
    with open(step / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"\0" * 64)
    with pytest.raises(PlanError, match="cannot load checkpoint") as err:
        train(loads_pipeline(pipeline_text(work, steps=6)))
    text = str(err.value)
    assert "UnpicklingError" in text, text
    assert "weights_only" not in text and "arbitrary code" not in text, text


def test_a_failed_final_save_keeps_the_checkpoints_and_says_where_to_point_dir(
        saved, monkeypatch):
    tmp, root, _ = saved
    work = tmp / "full"
    shutil.copytree(root, work)
    monkeypatch.setenv(ckpt.FAULT_ENV, "enospc-in-save:6")
    with pytest.raises(SaveFailed) as info:
        train(loads_pipeline(pipeline_text(work, steps=6)))
    v = info.value.violations[0]
    assert v.keys == ("checkpoint.dir",) and "cannot save step 6" in v.message
    assert "No space left on device" in v.message and "training state is intact" in v.message
    assert "point [checkpoint] dir at a writable directory" in v.hint
    assert sorted(p.name for p in work.iterdir()) == ["LATEST", "step_00000002",
                                                       "step_00000004"]


# -- the real launcher ----------------------------------------------------------------------

def _limit_memory() -> None:
    import resource

    # a CLI that loops on its own warnings fails here with MemoryError, not the machine
    resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))


def test_a_one_process_run_with_warnings_finishes(tmp_path):
    """``--nproc 1`` trains in the launcher's process, where DCP warns that it saves without a
    process group: the CLI re-emits such warnings once (it used to append them while re-emitting
    them, without end)."""
    path = write(tmp_path / "p.toml", pipeline_text(tmp_path / "ck", steps=2))
    done = subprocess.run([sys.executable, "-m", "shardgraph.train", "train", str(path),
                           "--nproc", "1"], capture_output=True, text=True, timeout=180,
                          preexec_fn=_limit_memory)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "saved" in done.stdout and done.stderr.count("UserWarning") <= 4, done.stderr



def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def workers(launcher: int) -> dict[int, int]:
    """RANK -> pid of the launcher's worker processes: its fork server's children, each
    named ``shardgraph-r<RANK>``."""
    parents, names = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = _ppid(int(entry.name))
                names[int(entry.name)] = (entry / "comm").read_text().strip()
            except (OSError, ValueError, IndexError):
                continue

    def under(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == launcher:
                return True
        return False

    return {int(name.removeprefix("shardgraph-r")): pid for pid, name in names.items()
            if name.startswith("shardgraph-r") and under(pid)}


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


class Launch:
    """``shardgraph train FILE --nproc 2`` in a subprocess.

    One reader per pipe: a thread owns stdout (lines kept as they come, so a test can wait
    for one), another owns stderr; the process is waited on, never ``communicate()``d, which
    would make a second reader of stdout and split its lines between the two.
    """

    def __init__(self, path: Path, env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shardgraph.train", "train", str(path), "--nproc", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self._err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(pipe, into), daemon=True)
                         for pipe, into in ((self.proc.stdout, self.lines),
                                            (self.proc.stderr, self._err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(pipe, into: list[str]) -> None:
        for line in pipe:
            into.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self._err)

    def wait_for(self, prefix: str, timeout: float = 150) -> None:
        deadline = time.monotonic() + timeout
        while not any(line.startswith(prefix) for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                self._drain()
                raise AssertionError(f"no {prefix!r} line: {''.join(self.lines)}\n{self.stderr}")
            time.sleep(0.1)

    def finish(self, timeout: float) -> int:
        """Wait for the launcher to exit and for both pipes to reach their end."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._drain()
        return self.proc.returncode

    def _drain(self) -> None:
        # the pipes close when the last process holding them (launcher or worker) exits
        for reader in self._readers:
            reader.join(30)

    def kill(self) -> None:
        for pid in workers(self.proc.pid).values():
            os.kill(pid, signal.SIGKILL)
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launch")
    return write(tmp / "long.toml", pipeline_text(tmp / "ck", steps=100000).replace(
        "every = 2", "every = 0"))


def test_a_worker_killed_mid_step_ends_the_job_naming_its_rank(long_run):
    run = Launch(long_run)
    run.wait_for("step    2/")
    ranks = workers(run.proc.pid)
    assert sorted(ranks) == [0, 1]
    os.kill(ranks[1], signal.SIGKILL)
    killed = time.monotonic()
    code = run.finish(timeout=90)
    assert time.monotonic() - killed < 60
    assert code == 1
    mine = [line for line in run.stderr.splitlines() if line.startswith("shardgraph")]
    assert len(mine) == 1 and "rank 1 was killed by SIGKILL" in mine[0], run.stderr
    assert "Traceback" not in run.stderr
    assert all(gone(pid) for pid in ranks.values())


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_stops_every_worker_in_one_line(long_run, sig, code):
    run = Launch(long_run)
    run.wait_for("step    2/")
    ranks = workers(run.proc.pid)
    run.proc.send_signal(sig)
    assert run.finish(timeout=60) == code
    mine = [line for line in run.stderr.splitlines() if line.startswith("shardgraph")]
    assert mine == [f"shardgraph train: stopped by {sig.name}; every worker was stopped"], \
        run.stderr
    assert "Traceback" not in run.stderr and "KeyboardInterrupt" not in run.stderr
    assert all(gone(pid) for pid in ranks.values())


def test_no_worker_outlives_a_launcher_killed_by_sigkill(long_run):
    """SIGKILL (the out-of-memory killer's signal) gives the launcher no chance to stop its
    workers: they must end by themselves, not train on as orphans."""
    run = Launch(long_run)
    run.wait_for("step    2/")
    ranks = workers(run.proc.pid)
    assert sorted(ranks) == [0, 1]
    run.proc.kill()
    run.proc.wait(30)
    deadline = time.monotonic() + 15
    while not all(gone(pid) for pid in ranks.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [pid for pid in ranks.values() if not gone(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived their launcher by 15 s"


def test_a_worker_error_reaches_the_user_and_a_failed_save_does_not_stop_training(tmp_path):
    """Rank 0's save of step 2 fails (every rank learns it, training goes on, the step-4 save
    works), then rank 1 raises after step 5 while rank 0 goes on into step 6's collectives:
    the report is rank 1's own error, not rank 0's lost connection."""
    path = write(tmp_path / "p.toml", pipeline_text(tmp_path / "ck", steps=8))
    run = Launch(path, env={ckpt.FAULT_ENV: "enospc-in-save:2,raise-in-step:5:1"})
    code = run.finish(timeout=180)
    out = "".join(run.lines)
    assert code == 1, run.stderr
    assert "warning: " in out and "cannot save step 2" in out and "step    4/8" in out
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path / "ck")] == ["step_00000004"]
    assert not (tmp_path / "ck" / "step_00000002.tmp").exists()
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("shardgraph train: rank 1 failed: RuntimeError: injected failure "
                           "after step 5 on rank 1"), run.stderr
    assert json.loads((tmp_path / "ck" / "step_00000004" / "meta.json").read_text())["step"] == 4


@pytest.mark.parametrize("code, returned, printed", [(None, 0, ""), (3, 3, ""),
                                                      ("no data at /x", 1, "no data at /x\n")])
def test_a_worker_ends_with_its_exit_code_and_prints_an_exit_message(
        code, returned, printed, monkeypatch, capsys):
    """A worker returns its exit code to the agent (a function's return, not the process's
    exit); ``sys.exit("message")`` in it prints the message and ends it with code 1, as an
    interpreter of its own (torchrun's ``python -m shardgraph.train``) would."""
    import runpy

    from shardgraph.train import launch

    def run_module(*args, **kwargs):
        raise SystemExit(code)

    monkeypatch.setattr(runpy, "run_module", run_module)
    monkeypatch.setattr(launch, "_name", lambda name: None)
    monkeypatch.setattr(launch, "in_worker", False)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    environ = dict(os.environ)
    try:
        assert launch._worker(["train", "p.toml"], {**environ, "RANK": "0"}, environ) == returned
    finally:
        os.environ.clear()
        os.environ.update(environ)
    assert capsys.readouterr().err == printed


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_take_the_launchers_environment_at_launch_not_the_fork_servers(
        method, tmp_path, monkeypatch, capsys):
    """The workers are forked from a fork server started once per launcher process
    (``shardgraph.train.launch``), with the environment of that moment. A launch from a
    process whose environment has changed since (a library caller's second launch) gives its
    workers the environment of now: here a failure injected by a variable set after the
    server started reaches rank 1, and the report names it. Where CUDA is available each
    worker is spawned instead (a fresh interpreter): the same launch, the same report."""
    from shardgraph.train import launch

    monkeypatch.setattr(launch, "_method", lambda: method)
    launch.start()
    monkeypatch.setenv(ckpt.FAULT_ENV, "raise-in-step:1:1")
    path = write(tmp_path / "p.toml", pipeline_text(tmp_path / "ck", steps=2))
    assert _dist.command("train", path, "--nproc", 2) == 1
    err = capsys.readouterr().err
    assert "shardgraph train: rank 1 failed: RuntimeError: injected failure after step 1 on " \
        "rank 1" in err, err
