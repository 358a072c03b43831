"""``examples/lora_finetune.toml`` end to end: LoRA under tp 2 x fsdp2, its checkpoints, resume,
and the peft round trip of the README.

The README block makes the local HF directory and data (as for the full fine-tuning example);
four ranks train four AdamW steps (weight decay, a clip active at every step) with a checkpoint
every two steps and both exports. Checked against one process (the same pipeline with lora
alone): the same losses (2e-5) and gradient norms (1e-4 relative); the checkpoints hold the
adapters and their optimizer state only; one process resuming from the four-rank checkpoint of
step 2 gives the one-process losses of steps 3 and 4 (2e-5);
``shardgraph export``'s function, in one process from the four-rank checkpoint, writes the
same merged model and adapters as the end of training (1e-6);
``peft.PeftModel.from_pretrained(base, export_peft)`` computes the logits of the merged
``export_hf`` (1e-5), which differ from the base's.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest
import torch

from shardgraph import Graph
from shardgraph.train import load_pipeline, train
from shardgraph.train.config import CheckpointConfig
from tests import _dist

pytest.importorskip("datasets", reason="text data needs the `data` extra")
pytest.importorskip("peft", reason="the round trip loads the adapters with peft (`dev` extra)")

from tests.test_finetune_example import _readme_block  # noqa: E402 - after the skips

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "lora_finetune.toml"
STEPS = 4
CLIP = 0.05  # below every step's gradient norm here: the clip is active at every step


def _pipeline(root: Path, *, alone: bool, **checkpoint):
    p = load_pipeline(EXAMPLE)
    graph = Graph(entries=[e for e in p.graph.entries if e.name == "lora"]) if alone else p.graph
    return attrs.evolve(p, graph=graph, checkpoint=CheckpointConfig(**checkpoint),
                        train=attrs.evolve(p.train, grad_clip=CLIP))


def _finetune(rank: int, world: int, root: str) -> dict:
    os.chdir(root)
    done = train(_pipeline(Path(root), alone=False, dir="ckpt", every=2, keep=2,
                           export_hf="merged", export_peft="adapter"), steps=STEPS)
    return {"losses": [r["loss"] for r in done["rows"]],
            "norms": [r["grad_norm"] for r in done["rows"]],
            "plan": [s.plugin for s in done["plan"].steps]}


@pytest.mark.multiprocess
def test_lora_example_trains_resumes_and_round_trips_through_peft(tmp_path, monkeypatch):
    from peft import PeftModel
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)
    exec(compile(_readme_block(), "README.md", "exec"), {})
    rows = train(_pipeline(tmp_path, alone=True), steps=STEPS)["rows"]
    ref, norms = [r["loss"] for r in rows], [r["grad_norm"] for r in rows]
    got = _dist.run(_finetune, 4, str(tmp_path), timeout=400)[0]
    assert got["plan"] == ["lora", "tp", "fsdp2"]
    assert got["losses"] == pytest.approx(ref, abs=2e-5)
    assert got["norms"] == pytest.approx(norms, rel=1e-4) and min(norms) > CLIP
    assert got["losses"][-1] < got["losses"][0]

    saved = FileSystemReader(str(tmp_path / "ckpt" / "step_00000004")).read_metadata()
    model_keys = [k for k in saved.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys)
    optim_keys = [k for k in saved.state_dict_metadata if k.startswith("optim.state.")]
    assert optim_keys and all(".lora_" in k for k in optim_keys)

    resumed = train(_pipeline(tmp_path, alone=True, dir="ckpt",
                              resume=str(tmp_path / "ckpt" / "step_00000002")), steps=STEPS)
    assert [r["step"] for r in resumed["rows"]] == [3, 4]
    assert [r["loss"] for r in resumed["rows"]] == pytest.approx(ref[2:], abs=2e-5)

    # `shardgraph export` of the last checkpoint, in one process: the base from [model] path,
    # the adapters from the checkpoint; the same merged weights as the end of training wrote
    from safetensors.torch import load_file

    from shardgraph.train.export import export_checkpoint

    written = export_checkpoint(_pipeline(tmp_path, alone=True),
                                tmp_path / "ckpt" / "step_00000004", tmp_path / "again")
    assert written == [tmp_path / "again", tmp_path / "again-adapter"]
    for name in ("again/model.safetensors", "again-adapter/adapter_model.safetensors"):
        ours, theirs = load_file(tmp_path / name), load_file(
            tmp_path / name.replace("again-adapter", "adapter").replace("again", "merged"))
        assert ours.keys() == theirs.keys()
        assert all(torch.allclose(ours[k], theirs[k], atol=1e-6) for k in ours), name

    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained("finetune/tiny-llama")
    before = base(input_ids=tokens).logits
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    with torch.no_grad():
        a, b = adapted(input_ids=tokens).logits, merged(input_ids=tokens).logits
    assert (a - b).abs().max().item() < 1e-5
    assert (a - before).abs().max().item() > 1e-3  # the adapters trained
