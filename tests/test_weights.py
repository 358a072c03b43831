"""Models larger than one rank: built on ``meta``, sharded, then each rank fills only its shards.

One world-4 gloo group runs every scenario:
- seeded init under tp 2 x sp x fsdp2 and pp 2 x fsdp2 (also with tied embeddings, exported and
  checkpointed under pp with the tied weight once): the full state dict gathered with
  ``full_tensor()`` equals the one-process model bit for bit; under fsdp2, hsdp, ddp, cp 2 x
  fsdp2 and ep 2 x fsdp2 (Qwen3-MoE) every rank's local shards equal its slice of the
  one-process weights, bit for bit;
- a bf16 HF checkpoint saved in several safetensors files loads under tp 2 x fsdp2 (each rank
  reads its slices, converted to fp32) equal to one process loading it whole;
- the tp 2 x fsdp2 model is exported sharded (several files + index) without a gather, and
  ``from_pretrained`` reads back exactly its weights;
- peak resident memory per rank while a 33M-parameter model (132 MB in fp32) is built, sharded
  over 4 ranks and initialised grows by at most its shards plus one module in full plus 24 MiB,
  and by less than half the model (the whole-model start held all of it); glibc returns freed
  memory (MALLOC_* below), so resident size is live memory.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
import torch

from shardgraph.core.errors import PlanError
from tests import _dist

VOCAB = 128
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
             use_cache=False)
MOE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
           num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, attn_implementation="sdpa", use_cache=False)
#: 33M parameters (132 MB in fp32): embedding and head 2 x 4.1M, 8 layers of 3.1M
BIG = dict(vocab_size=8000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
           num_attention_heads=8, num_key_value_heads=8, attn_implementation="sdpa",
           use_cache=False)
SEED = 11


def meta(kind: str = "llama", **config):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from shardgraph.weights import meta_params

    if kind == "tied":  # input embedding and LM head share one weight
        kind, config = "llama", {"tie_word_embeddings": True, **config}
    cls, cfg = ((LlamaForCausalLM, LlamaConfig(**{**LLAMA, **config})) if kind == "llama" else
                (Qwen3MoeForCausalLM, Qwen3MoeConfig(**MOE)))
    with meta_params():
        return cls(cfg)


def one_process(kind: str = "llama") -> dict[str, torch.Tensor]:
    import shardgraph as sg
    from shardgraph.weights import seeded_init

    plan = sg.Graph().compile(world_size=1)
    model = meta(kind)
    model = plan.apply(model, plan.build_mesh("cpu"),
                       init=seeded_init(SEED, model._init_weights)).module
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _graphs():
    import shardgraph as sg

    return {
        "tp2_sp_fsdp2": (sg.Graph().add("tp", size=2).add("sp").add("fsdp2"), "llama", True),
        "pp2_fsdp2": (sg.Graph().add("pp", size=2).add("fsdp2"), "llama", True),
        "pp2_fsdp2_tied": (sg.Graph().add("pp", size=2).add("fsdp2"), "tied", True),
        "fsdp2": (sg.Graph().add("fsdp2"), "llama", False),
        "hsdp": (sg.Graph().add("hsdp", size=2).add("fsdp2"), "llama", False),
        "ddp": (sg.Graph().add("ddp"), "llama", False),
        "cp2_fsdp2": (sg.Graph().add("cp", size=2).add("fsdp2"), "llama", False),
        "ep2_fsdp2": (sg.Graph().add("ep", size=2).add("fsdp2"), "moe", False),
    }


def _full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _local_mismatches(model, ref: dict[str, torch.Tensor]) -> list[str]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    from shardgraph.weights import local_part

    bad = []
    for name, p in get_model_state_dict(model).items():
        local = p.to_local() if isinstance(p, DTensor) else p
        if not torch.equal(local, local_part(ref[name], p)):
            bad.append(name)
    return bad


def _in_group(rank: int, world: int, refs: dict, hf_dir: str, out_dir: str,
              tied_dir: str) -> dict:
    import torch.distributed as dist

    import shardgraph as sg
    from shardgraph.train.save import save
    from shardgraph.weights import hf_load, save_hf, seeded_init, tensor_specs

    result: dict = {}
    for name, (graph, kind, gather) in _graphs().items():
        plan = graph.compile(world_size=world)
        model = meta(kind)
        model = plan.apply(model, plan.build_mesh("cpu"),
                           init=seeded_init(SEED, model._init_weights)).module
        if kind == "tied":  # exported and checkpointed with the weight once
            save_hf(model, Path(tied_dir) / "hf", config=model.config,
                    all_tensors=tensor_specs(meta(kind)))
            save(Path(tied_dir) / "dcp", 1, model,
                 torch.optim.AdamW(model.parameters()), {}, keep=1)
        if gather:
            state = _full_state(model)
            if name.startswith("pp"):  # each pp rank gathers its stage's parameters
                parts: list = [None] * world
                dist.all_gather_object(parts, state)
                state = {k: v for part in parts for k, v in part.items()}
            want = refs[kind]
            result[name] = sorted(k for k in want if not torch.equal(state.get(k), want[k])) \
                if state.keys() == want.keys() else [f"keys differ: {set(state) ^ set(want)}"]
        else:
            result[name] = _local_mismatches(model, refs[kind])
    # a bf16 checkpoint in several files, read sharded into an fp32 tp x fsdp2 model
    plan = sg.Graph().add("tp", size=2).add("fsdp2").compile(world_size=world)
    model = plan.apply(meta(), plan.build_mesh("cpu"), init=hf_load(hf_dir)).module
    result["hf_load"] = _local_mismatches(model, refs["hf"])
    # and written back sharded, without a gather
    specs = tensor_specs(meta())
    save_hf(model, out_dir, config=model.config, all_tensors=specs, source_dir=hf_dir,
            max_shard_bytes=200_000)
    result["saved"] = {k: v.detach().clone() for k, v in _full_state(model).items()}
    dist.barrier()
    return result


def _peak_growth(rank: int, world: int) -> dict:
    import shardgraph as sg
    from shardgraph.weights import seeded_init

    plan = sg.Graph().add("fsdp2").compile(world_size=world)
    ctx = plan.build_mesh("cpu")
    warm = meta()  # imports, the mesh and one tiny model first: only the big model is measured
    plan.apply(warm, ctx, init=seeded_init(SEED, warm._init_weights))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = meta(**BIG)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(sum(p.numel() * 4 for p in m.parameters(recurse=False))
                  for m in model.modules())
    model = plan.apply(model, ctx, init=seeded_init(SEED, model._init_weights)).module
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    local = sum(p.to_local().numel() * 4 for p in model.parameters())
    return {"growth": after - before, "full": full, "local": local, "largest": largest}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("hf") / "tiny"
    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).to(torch.bfloat16)
    model.save_pretrained(str(path), max_shard_size="60KB")  # several files and an index
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return path


@pytest.mark.multiprocess
def test_sharded_start_init_load_and_export(hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from shardgraph.weights import hf_load, materialize, read_headers

    assert len(list(hf_dir.glob("*.safetensors"))) > 1
    refs = {"llama": one_process("llama"), "moe": one_process("moe")}
    whole = materialize(meta(), "cpu", hf_load(hf_dir))
    refs["hf"] = {k: v.detach().clone() for k, v in whole.state_dict().items()}
    assert all(v.dtype == torch.float32 for v in refs["hf"].values())
    refs["tied"] = one_process("tied")
    out = tmp_path / "export"
    results = _dist.run(_in_group, 4, refs, str(hf_dir), str(out), str(tmp_path), timeout=400)
    for name in [*_graphs(), "hf_load"]:
        for rank, r in enumerate(results):
            assert r[name] == [], (name, rank, r[name][:5])
    # the export: HF's layout, several files, tokenizer files carried, read back exactly
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("*.safetensors"))) > 1
    assert (out / "tokenizer_config.json").is_file() and not (out / "sharded").exists()
    assert not out.with_name("export.tmp").exists()
    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    saved = results[0]["saved"]
    assert all(torch.equal(v, saved[k]) for k, v in back.state_dict().items())
    assert saved.keys() == back.state_dict().keys()
    # tied embeddings under pp 2 x fsdp2: the export and the checkpoint hold the weight once,
    # under the embedding's name, and read back as one process's tied model
    tied = refs["tied"]
    assert torch.equal(tied["lm_head.weight"], tied["model.embed_tokens.weight"])
    exported = read_headers(tmp_path / "hf")
    assert "model.embed_tokens.weight" in exported and "lm_head.weight" not in exported
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    assert all(torch.equal(v, tied[k]) for k, v in back.state_dict().items())
    import torch.distributed.checkpoint as dcp

    from shardgraph.train import checkpoint as ckpt

    step = ckpt.latest(tmp_path / "dcp")
    stored = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    assert "model.model.embed_tokens.weight" in stored and "model.lm_head.weight" not in stored
    one = meta("tied")
    one = materialize(one, "cpu", lambda m: None)
    ckpt.load(step, one, None)
    assert one.lm_head.weight is one.model.embed_tokens.weight
    assert all(torch.equal(v, tied[k]) for k, v in one.state_dict().items())
    # seeded weights follow the model's own init: normal(0, 0.02) matrices, unit norms
    ref = refs["llama"]
    assert abs(ref["model.layers.0.mlp.up_proj.weight"].std().item() - 0.02) < 2e-3
    assert torch.equal(ref["model.norm.weight"], torch.ones(64))


@pytest.mark.multiprocess
def test_no_rank_holds_the_whole_model(monkeypatch):
    # glibc returns freed blocks at once, so resident size is what is alive (read when a
    # process starts: spawned ranks, not ones forked from a server started without them)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    results = _dist.run(_peak_growth, 4, timeout=300, start_method="spawn")
    for r in results:
        # 132 MB whole: a quarter of it as shards, plus one module drawn in full at a time
        # (the 16 MB embedding) and 24 MiB for the mesh, the process groups and the allocator
        assert r["local"] * 4 >= r["full"] * 0.99
        figures = {k: v / 2**20 for k, v in r.items()}
        assert r["growth"] < r["local"] + r["largest"] + 24 * 2**20, figures
        assert r["growth"] < 0.5 * r["full"], figures


def test_checkpoint_problems_name_key_and_file(hf_dir, tmp_path):
    import shutil

    from shardgraph.weights import check_checkpoint, tensor_specs

    shapes = {n: s for n, (s, _) in tensor_specs(meta()).items()}
    assert check_checkpoint(shapes, hf_dir) == []
    wrong = dict(shapes, **{"model.norm.weight": (32,), "model.extra.weight": (2,)})
    del wrong["lm_head.weight"]
    found = check_checkpoint(wrong, hf_dir)
    text = "\n".join(v.message for v in found)
    assert "model.extra.weight" in text  # missing from the checkpoint
    assert "lm_head.weight (model-" in text  # unexpected, with its file
    assert "model.norm.weight in model-" in text and "[64]" in text  # shape, file
    assert {v.keys for v in found} == {("model.path",)}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no *.safetensors" in check_checkpoint(shapes, empty)[0].message
    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    victim = sorted(broken.glob("*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    assert "not a readable safetensors file" in check_checkpoint(shapes, broken)[0].message


def test_export_never_replaces_a_complete_directory(tmp_path):
    from shardgraph.weights import materialize, save_hf, seeded_init, tensor_specs

    model = meta()
    model = materialize(model, "cpu", seeded_init(0, model._init_weights))
    out = tmp_path / "out"
    (tmp_path / "out.tmp").mkdir()  # a crashed export: replaced
    (tmp_path / "out.tmp" / "junk").write_text("x")
    save_hf(model, out, config=model.config, all_tensors=tensor_specs(model))
    assert (out / "model.safetensors").is_file() and not (out / "junk").exists()
    with pytest.raises(PlanError, match="exists and is not empty"):
        save_hf(model, out, config=model.config, all_tensors=tensor_specs(model))
