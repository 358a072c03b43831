"""GPU presets from vendors' datasheets, and the ``[cluster]`` table that overrides them.

Figures are per GPU: dense (not sparse) BF16 tensor-core peak, HBM capacity and bandwidth, the
one-direction bandwidth to the other GPUs of the node (NVLink / Infinity Fabric), and the
one-direction network bandwidth of the NIC(s) a GPU has to other nodes. Latencies are typical
NCCL/RCCL small-message figures, not datasheet values: they matter only for small collectives.

Efficiencies (what fraction of a peak a real step reaches) are not datasheet values either:
they are fitted on published measurements (``calibration.py``) and reported in every estimate's
``assumptions``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ..core.errors import PlanError, Violation, choices_hint, did_you_mean
from ..core.options import structure_options

GiB = 2**30


@attrs.frozen
class GPU:
    name: str
    #: dense BF16 tensor-core peak, FLOP/s
    peak_flops: float
    #: HBM capacity (bytes) and bandwidth (bytes/s)
    hbm_bytes: float
    hbm_bw: float
    #: one-direction bandwidth to a GPU of the same node, and of the GPU's network link (bytes/s)
    intra_bw: float
    inter_bw: float
    #: per-collective latency inside a node and across nodes (s)
    intra_latency: float = 5e-6
    inter_latency: float = 15e-6
    #: what the datasheet figures come from
    source: str = ""
    #: float8 tensor cores (Hopper, Blackwell, CDNA 3)
    fp8: bool = True
    #: GPUs of one NVLink domain: the planner's node where neither the command, ``[cluster]``
    #: nor ``[mesh]`` gives ``gpus_per_node`` (a GB200 NVL72 rack: 72)
    gpus_per_node: int = 8
    #: the preset whose fitted ceiling and attention share price this one until it has its own:
    #: the same compute die (H200 is H100's with more and faster HBM; GB200's GPU is B200's at a
    #: higher clock)
    same_die: str | None = None


# Datasheet figures. A100: NVIDIA A100 datasheet (SXM4 80GB: 312 TFLOPS BF16, 2,039 GB/s; SXM4
# 40GB: 1,555 GB/s; NVLink 600 GB/s both directions) with one 200 Gb/s HDR NIC per GPU (DGX A100).
# H100-SXM / H200: NVIDIA H100 and H200 datasheets (989 TFLOPS BF16 dense, NVLink 900 GB/s both
# directions) with one 400 Gb/s NDR NIC per GPU (DGX H100 / H200). B200: DGX B200 datasheet
# (72 PFLOPS FP8 training with sparsity per 8 GPUs -> 2.25 PFLOPS dense BF16 per GPU, 1,440 GB
# HBM3e per 8 GPUs, NVLink 5 1.8 TB/s both directions, 400 Gb/s per GPU). GB200: GB200 NVL72
# datasheet (180 PFLOPS FP16/BF16 dense per 72 GPUs -> 2.5 PFLOPS a GPU, 13.4 TB HBM3e at 576
# TB/s per 72 -> 186 GB and 8 TB/s, NVLink 5 1.8 TB/s both directions among all 72 GPUs of the
# rack: one NVLink domain, ``gpus_per_node = 72``) with one 400 Gb/s ConnectX-7 NIC per GPU
# (MLPerf v5.0's Tyche: 4 per tray of 4 GPUs). MI300X: AMD Instinct
# MI300X datasheet (1,307.4 TFLOPS BF16 dense, 192 GB HBM3 at 5.3 TB/s, 896 GB/s aggregate
# Infinity Fabric both directions) with one 400 Gb/s NIC per GPU.
PRESETS: dict[str, GPU] = {g.name: g for g in (
    GPU("A100-80GB", 312e12, 80 * GiB, 2.039e12, 300e9, 25e9, fp8=False,
        source="NVIDIA A100 datasheet; DGX A100 (8x 200 Gb/s HDR)"),
    GPU("A100-40GB", 312e12, 40 * GiB, 1.555e12, 300e9, 25e9, fp8=False, same_die="A100-80GB",
        source="NVIDIA A100 datasheet (SXM4 40GB); DGX A100 (8x 200 Gb/s HDR)"),
    GPU("H100-SXM", 989e12, 80 * GiB, 3.35e12, 450e9, 50e9,
        source="NVIDIA H100 datasheet (SXM5); DGX H100 (8x 400 Gb/s NDR)"),
    GPU("H200", 989e12, 141e9, 4.8e12, 450e9, 50e9, same_die="H100-SXM",
        source="NVIDIA H200 datasheet (SXM); DGX H200 (8x 400 Gb/s NDR)"),
    GPU("B200", 2.25e15, 180e9, 8.0e12, 900e9, 50e9,
        source="NVIDIA DGX B200 datasheet (per GPU: 1/8 of the system); 400 Gb/s per GPU"),
    GPU("GB200", 2.5e15, 186e9, 8.0e12, 900e9, 50e9, gpus_per_node=72, same_die="B200",
        source="NVIDIA GB200 NVL72 datasheet (per GPU: 1/72 of the rack, "
        "one NVLink domain of 72); 400 Gb/s per GPU"),
    GPU("MI300X", 1307.4e12, 192e9, 5.3e12, 448e9, 50e9, intra_latency=8e-6,
        source="AMD Instinct MI300X datasheet; 400 Gb/s per GPU"),
)}
DEFAULT_GPU = "H100-SXM"
#: each preset priced with another's fitted constants until it has its own (``GPU.same_die``)
SAME_DIE = {g.name: g.same_die for g in PRESETS.values() if g.same_die}


@attrs.frozen
class ClusterTable:
    """``[cluster]``: the GPU preset and any figure to override (units in the key names)."""

    gpu: str | None = None
    gpus_per_node: int | None = None
    peak_tflops: float | None = None
    hbm_gib: float | None = None
    hbm_tbps: float | None = None
    #: one-direction GB/s (1e9 bytes/s) inside a node and per GPU across nodes
    intra_node_gbps: float | None = None
    network_gbps: float | None = None
    intra_latency_us: float | None = None
    inter_latency_us: float | None = None


def cluster_table(raw: Any, bad: list[Violation] | None = None) -> ClusterTable:
    """``[cluster]`` read strictly. ``bad``: where its problems go (all of them; a key that
    fails keeps its default, so the others are still read), else they raise."""
    problems: list[Violation] = []
    value = ClusterTable()
    if raw is not None and not isinstance(raw, Mapping):
        problems.append(Violation("type", ("cluster",), f"cluster must be a table, got {raw!r}",
                                  hint="write [cluster] with its keys below"))
    elif raw is not None:
        found, problems = structure_options(ClusterTable, dict(raw), lambda k: f"cluster.{k}",
                                            "cluster", section=True)
        if found is None:
            failed = {k for k in raw if f"cluster.{k}" in {k for v in problems for k in v.keys}}
            found, _ = structure_options(ClusterTable, {k: v for k, v in raw.items()
                                                        if k not in failed},
                                         lambda k: f"cluster.{k}", "cluster", section=True)
        value = found or value
    if bad is None and problems:
        raise PlanError(problems)
    if bad is not None:
        bad += problems
    return value


def resolve_gpu(name: str | None, table: ClusterTable | None = None, *,
                name_key: str = "--gpu", bad: list[Violation] | None = None) -> GPU:
    """The preset ``name`` (else ``[cluster] gpu``, else H100-SXM) with ``table``'s overrides.
    ``bad``: where its problems go (all at once; then the default preset stands in), else
    they raise."""
    table = table or ClusterTable()
    # an empty name is a mistake to name, not a request for the default
    chosen = name if name is not None else table.gpu if table.gpu is not None else DEFAULT_GPU
    key = name_key if name is not None else "cluster.gpu"
    found = {n.lower(): g for n, g in PRESETS.items()}.get(chosen.lower())
    problems = []
    if found is None:
        problems.append(Violation(
            "value", (key,), f"{key} names no GPU (it is empty)" if not chosen.strip() else
            f"unknown GPU {chosen!r}{did_you_mean(chosen, list(PRESETS))}",
            hint=choices_hint(chosen, list(PRESETS)) + "; or override figures in [cluster]"))
        found = PRESETS[DEFAULT_GPU]
    problems += [Violation("value", (f"cluster.{f.name}",), f"cluster.{f.name} must be > 0, "
                           f"got {getattr(table, f.name)}", hint="give a positive number")
                 for f in attrs.fields(ClusterTable)
                 if f.name not in ("gpu",) and getattr(table, f.name) is not None
                 and getattr(table, f.name) <= 0]
    if bad is None and problems:
        raise PlanError(problems)
    if problems:
        bad += problems
        return found
    scaled = {
        "peak_flops": (table.peak_tflops, 1e12), "hbm_bytes": (table.hbm_gib, GiB),
        "hbm_bw": (table.hbm_tbps, 1e12), "intra_bw": (table.intra_node_gbps, 1e9),
        "inter_bw": (table.network_gbps, 1e9), "intra_latency": (table.intra_latency_us, 1e-6),
        "inter_latency": (table.inter_latency_us, 1e-6),
    }
    changes = {k: v * unit for k, (v, unit) in scaled.items() if v is not None}
    if changes:
        found = attrs.evolve(found, source=found.source + "; overridden by [cluster]: "
                             + ", ".join(sorted(changes)), **changes)
    return found
