"""The README's fine-tuning lines and ``examples/finetune_local_hf.toml``, end to end.

The README block makes a local HF directory (a tiny Llama + a word-level tokenizer) and a
prompt/completion jsonl in a temporary directory; the example then fine-tunes it under
tp 2 x fsdp2 at its world size, 4 (at 2 it would be tp alone), and exports. Checked: the same
losses as one process (2e-5 over 4 AdamW steps), the export loads with ``from_pretrained``
bit-identical to the trained weights, those differ from the weights it started from, and the
export's tokenizer is the model directory's. 60-100 s on 2 busy cores (4 ranks).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import attrs
import pytest
import torch

from shardgraph.train import load_pipeline
from shardgraph.train.config import CheckpointConfig
from tests import _dist

pytest.importorskip("datasets", reason="text data needs the `data` extra")

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "finetune_local_hf.toml"
STEPS = 4


def _readme_block() -> str:
    blocks = re.findall(r"```python notest\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    found = [b for b in blocks if "finetune/tiny-llama" in b]
    assert len(found) == 1, "the README makes the example's files in one Python block"
    return found[0]


def _pipeline(root: Path, plugins: bool):
    p = load_pipeline(EXAMPLE)
    graph = p.graph if plugins else type(p.graph)()
    out = CheckpointConfig(export_hf=str(root / "hf")) if plugins else CheckpointConfig()
    return attrs.evolve(p, graph=graph, checkpoint=out)


def _finetune(rank: int, world: int, root: str) -> dict:
    import os

    from shardgraph.train import train
    from shardgraph.train import checkpoint as ckpt

    os.chdir(root)  # the example's paths are relative, as in the README
    done = train(_pipeline(Path(root), plugins=True), steps=STEPS)
    state = ckpt.full_state_dict(done["model"].module)
    return {"losses": [r["loss"] for r in done["rows"]],
            "plan": [s.plugin for s in done["plan"].steps], "state": dict(state)}


@pytest.mark.multiprocess
def test_readme_files_then_the_example_fine_tunes_under_tp_fsdp2_and_exports(tmp_path,
                                                                             monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardgraph.train import train
    from shardgraph.train.data import check
    from shardgraph.train.loop import compile_for
    from shardgraph.train.model import hf_config

    monkeypatch.chdir(tmp_path)
    exec(compile(_readme_block(), "README.md", "exec"), {})
    example = load_pipeline(EXAMPLE)
    assert [s.plugin for s in compile_for(example, 4).steps] == ["tp", "fsdp2"]
    config = hf_config(example.model)
    assert check(example, config.vocab_size, config.max_position_embeddings) == []

    ref = [r["loss"] for r in train(_pipeline(tmp_path, plugins=False), steps=STEPS)["rows"]]
    got = _dist.run(_finetune, 4, str(tmp_path), timeout=300)[0]
    assert got["plan"] == ["tp", "fsdp2"]
    assert got["losses"] == pytest.approx(ref, abs=2e-5)
    assert got["losses"][-1] < got["losses"][0]

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).state_dict()
    # the export carries the tokenizer of model.path: the same ids for the same text
    rows = (tmp_path / "finetune" / "data.jsonl").read_text().splitlines()[:3]
    texts = [json.loads(r)["prompt"] for r in rows]
    ids = [AutoTokenizer.from_pretrained(d, local_files_only=True)(texts)["input_ids"]
           for d in (str(tmp_path / "hf"), "finetune/tiny-llama")]
    assert ids[0] == ids[1] and len(ids[0]) == 3
    start = load_file(str(tmp_path / "finetune" / "tiny-llama" / "model.safetensors"))
    for name, value in got["state"].items():
        assert torch.equal(exported[name], value), name
    assert not torch.equal(got["state"]["model.layers.0.mlp.up_proj.weight"],
                           start["model.layers.0.mlp.up_proj.weight"])
