"""``bench/gpu.sh``'s rows run end to end: a smoke run on CPU with a tiny Llama.

The benchmark measures a GPU (MFU of a 1.24B Llama on one H200) and cannot run its figures here;
what this checks is that its harness does not rot between the sessions that have a GPU: every
row's process builds the model, compiles the plan from plugin names, applies it and steps it
(``--device cpu --tiny``), and a row that cannot run on this machine (float8 without a CUDA
device of capability >= 8.9) is a table line naming the reason, not a crash.
"""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def refused(script: str, argv: list[str], capsys, monkeypatch) -> str:
    """``python bench/SCRIPT ARGV``'s refusal, run in this process (a process of its own would
    import torch again for a line): its stderr, after checking it exits with 2."""
    main = runpy.run_path(str(ROOT / "bench" / script), run_name="bench")["main"]
    monkeypatch.setattr(sys, "argv", [script, *argv])
    try:
        code = main()
    except SystemExit as exc:  # argparse's error
        code = exc.code
    assert code == 2
    return capsys.readouterr().err


def test_the_gpu_benchmark_rows_run_and_a_row_that_cannot_says_why(tmp_path, capsys,
                                                                   monkeypatch):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_mfu.py"), "--device", "cpu", "--tiny",
         "--rows", "base,float8_tensorwise", "--steps", "1", "--warmup", "1",
         "--seq", "32", "--batch", "2"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)  # imports without the cwd
    assert out.returncode == 0, out.stderr[-2000:]
    table = {line.split("|")[1].strip(): line for line in out.stdout.splitlines()
             if line.startswith("| ") and not line.startswith("| row")}
    assert set(table) == {"base", "float8_tensorwise"}, out.stdout
    cells = [c.strip() for c in table["base"].split("|")]
    assert float(cells[3]) > 0 and float(cells[4].replace(",", "")) > 0, table["base"]
    assert "1.00x" in table["base"]
    assert "float8 matmuls need a CUDA device" in table["float8_tensorwise"]
    # a GPU-only benchmark refuses a CPU run at full size instead of building 1.24B params
    assert "--tiny" in refused("gpu_mfu.py", ["--device", "cpu"], capsys, monkeypatch)


def test_the_attention_share_benchmark_runs_and_a_backend_that_cannot_says_why(
        tmp_path, capsys, monkeypatch):
    """``bench/gpu_attention.py`` (the first part of ``bench/gpu.sh``): on CPU with tiny shapes,
    a line per sequence length and SDPA backend, torch's default pick timed, a backend this
    machine lacks (cuDNN on CPU) a line naming why, and cp's chunk timed; at full size on CPU
    it refuses."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_attention.py"), "--device", "cpu", "--tiny",
         "--repeats", "2"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| seq")]
    cp = "cp chunk (lower right, GQA; flash no)"  # cp's attention; no flash kernel on CPU
    assert [(r[0], r[1]) for r in rows] == [(s, b) for s in ("64", "128") for b in (
        "default", "FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", cp)], out.stdout
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows if r[1] == cp), out.stdout
    default = [r for r in rows if r[1] == "default"]
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in default), default
    assert any(r[2] == "n/a" and r[4] for r in rows if r[1] == "CUDNN_ATTENTION"), out.stdout
    assert "the planner's attention shares" in out.stdout
    assert "--tiny" in refused("gpu_attention.py", ["--device", "cpu"], capsys, monkeypatch)
