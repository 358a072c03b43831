"""HF safetensors checkpoints, read and written sharded through ``torch.distributed.checkpoint``.

Loading: every rank asks DCP's ``HuggingFaceStorageReader`` for the slices its (DTensor)
parameters hold; safetensors reads them lazily, so no rank reads, let alone holds, the whole
model. Values are converted to the parameter's dtype slice by slice.

Saving: every rank writes its own shards (``HuggingFaceStorageWriter(save_distributed=True)``),
then the ranks consolidate them file by file into HF's layout (``model-0000i-of-0000n``
safetensors and ``model.safetensors.index.json``) reading byte ranges from disk, never a whole
model in memory. Everything is written into ``<out>.tmp`` and renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core.errors import PlanError, Violation
from ._init import _named_modules, canonical_name, draw_own, own_init_names

INDEX = "model.safetensors.index.json"
#: Files of an HF model directory that are not weights and travel with an export (tokenizer,
#: generation settings, chat template).
_WEIGHTS_OR_CONFIG = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def safetensors_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def read_headers(path: Path, key: str = "model.path") -> dict[str, tuple[str, tuple[int, ...], str]]:
    """``name -> (file name, shape, dtype)`` of every tensor in the safetensors files of
    ``path``, from their headers only."""
    from safetensors import safe_open

    found: dict[str, tuple[str, tuple[int, ...], str]] = {}
    bad: list[Violation] = []
    for f in safetensors_files(path):
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    piece = handle.get_slice(name)
                    if name in found:
                        bad.append(Violation("model", (key,), f"tensor {name!r} is in both "
                                             f"{found[name][0]} and {f.name}",
                                             hint="remove the stale file"))
                    found[name] = (f.name, tuple(piece.get_shape()), piece.get_dtype())
        except Exception as exc:  # safetensors raises its own error types for damaged files
            bad.append(Violation("model", (key,), f"{f} is not a readable safetensors file: "
                                 f"{exc}", hint="re-export the checkpoint"))
    if bad:
        raise PlanError(bad)
    return found


def aliases(model: nn.Module) -> set[str]:
    """The second and later names of a parameter that several modules hold (a tied LM head's
    ``lm_head.weight``; HF stores it once, as ``embed_tokens.weight``)."""
    seen: set[int] = set()
    out = set()
    for name, module in _named_modules(model):
        for pname, p in module._parameters.items():
            if p is not None and id(p) in seen:
                out.add(canonical_name(f"{name}.{pname}" if name else pname))
            elif p is not None:
                seen.add(id(p))
    return out


def _distinct(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``state`` without the aliases of tied parameters: each weight once, by its first name."""
    drop = aliases(model)
    return {name: t for name, t in state.items() if name not in drop}


def tensor_specs(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Canonical parameter names -> (global shape, dtype) of a (meta or parallelised) model."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {n: (tuple(t.shape), t.dtype)
            for n, t in _distinct(get_model_state_dict(model), model).items()}


def check_checkpoint(expected: dict[str, tuple[int, ...]], path: Path,
                     key: str = "model.path") -> list[Violation]:
    """Every problem between a model's parameters and the checkpoint in ``path``: missing,
    unexpected and misshapen tensors, each named with its file."""
    if not safetensors_files(path):
        return [Violation("model", (key,), f"{path} holds no *.safetensors file",
                          hint="point model.path at a directory written by save_pretrained "
                          "(safetensors), or remove it for seeded random weights")]
    try:
        found = read_headers(path, key)
    except PlanError as exc:
        return list(exc.violations)
    bad = []
    missing = [n for n in expected if n not in found]
    if missing:
        bad.append(Violation(
            "model", (key,), f"{len(missing)} parameter(s) of the model are not in {path}: "
            f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}",
            hint="point model.path at the directory of this model's weights, or fix "
            "model.config so the model matches them"))
    unexpected = [n for n in found if n not in expected]
    if unexpected:
        bad.append(Violation(
            "model", (key,), f"{len(unexpected)} tensor(s) in {path} are not parameters of the "
            f"model: {', '.join(f'{n} ({found[n][0]})' for n in unexpected[:4])}"
            f"{' ...' if len(unexpected) > 4 else ''}",
            hint="check model.config (layers, experts, tie_word_embeddings) against the "
            "checkpoint's config.json"))
    for n, shape in expected.items():
        if n in found and found[n][1] != shape:
            bad.append(Violation(
                "model", (key,), f"{n} in {found[n][0]} has shape {list(found[n][1])} but the "
                f"model expects {list(shape)}",
                hint="model.config does not match the checkpoint; remove the overriding "
                "values from model.config"))
    return bad


def hf_load(path: str | Path) -> Callable[[nn.Module], None]:
    """A ``fill`` for ``materialize``: each rank reads only its slices of ``path``."""
    path = Path(path)

    def fill(model: nn.Module) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            set_model_state_dict,
        )

        # modules a plugin added that draw themselves (LoRA's adapters) are not in the
        # checkpoint of the model they were added to
        own = own_init_names(model)
        state = {n: t for n, t in _distinct(get_model_state_dict(model), model).items()
                 if n not in own}
        bad = check_checkpoint({n: tuple(t.shape) for n, t in state.items()}, path)
        if bad:
            raise PlanError(bad)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
            dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)))
        set_model_state_dict(model, state, options=_strict_false())
        if own:
            draw_own(model)

    return fill


def _strict_false():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=False)  # tied duplicates were left out on purpose


def file_plan(sizes: Iterable[tuple[str, int]], max_bytes: int) -> dict[str, int]:
    """``name -> file index`` (1-based), filling files in order up to ``max_bytes`` each."""
    out: dict[str, int] = {}
    index, used = 1, 0
    for name, nbytes in sizes:
        if used and used + nbytes > max_bytes:
            index, used = index + 1, 0
        out[name] = index
        used += nbytes
    return out


def save_hf(model: nn.Module, out: str | Path, *, config, all_tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
            source_dir: str | Path | None = None, max_shard_bytes: int = 4 << 30,
            key: str = "checkpoint.export_hf") -> Path:
    """Write ``model`` (parallelised or not) as an HF directory at ``out``; a collective.

    ``all_tensors``: name -> (shape, dtype) of every parameter of the whole model (a rank under
    pp holds only its stages', so the file plan comes from the unsplit model).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = _distinct(get_model_state_dict(model), model)
    state = {n: t for n, t in state.items() if n in all_tensors}
    sizes = [(n, _nbytes(shape, dtype)) for n, (shape, dtype) in all_tensors.items()]

    def finish(tmp: Path) -> None:
        files = safetensors_files(tmp)
        if len(files) == 1:  # HF's name for an unsharded checkpoint, which has no index
            files[0].rename(tmp / "model.safetensors")
            (tmp / INDEX).unlink(missing_ok=True)
        config.save_pretrained(str(tmp))
        if source_dir is not None:
            for f in Path(source_dir).iterdir():
                if f.is_file() and not f.name.endswith(_WEIGHTS_OR_CONFIG) \
                        and f.name not in ("config.json", INDEX) and not f.name.endswith(".json.part"):
                    shutil.copy2(f, tmp / f.name)

    return write_safetensors(state, out, file_plan(sizes, max_shard_bytes), key=key,
                             finish=finish)


def write_safetensors(state: dict[str, torch.Tensor], out: str | Path, files: dict[str, int],
                      *, key: str, finish: Callable[[Path], None]) -> Path:
    """Write ``state`` (this rank's tensors, DTensors whole or sharded, under the names they get
    in the files) as consolidated safetensors into the new directory ``out``; a collective.

    ``files``: every name of the whole model -> its file index (1-based; a pipeline rank holds
    only its stages' names). Each rank writes the shards it holds (DCP's
    ``HuggingFaceStorageWriter``), the ranks consolidate them file by file, then rank 0 calls
    ``finish(tmp)`` to add the directory's other files before it moves into place whole.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files_on_every_rank,
    )

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if _rank() == 0:
        if out.exists() and any(out.iterdir()):
            raise PlanError([Violation("checkpoint", (key,), f"{out} exists and is not empty",
                                       hint="choose a new directory or remove it")])
        if tmp.exists():  # a crashed export: never complete
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    sharded = tmp / "sharded"
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(
            str(sharded), save_distributed=True, fqn_to_index_mapping=files))
    _barrier()
    consolidate_safetensors_files_on_every_rank(str(sharded), str(tmp), files)
    if _rank() == 0:
        shutil.rmtree(sharded)
        finish(tmp)
        _fsync_dir(tmp)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    _barrier()
    return out


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as handle:
                os.fsync(handle.fileno())
