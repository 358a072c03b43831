"""The planner's estimates and searches as text (what ``shardgraph estimate`` and ``plan
--auto`` print)."""

from __future__ import annotations

from typing import Any

from ..graphs.toml import distributed_form

GiB = 2**30


def memory_lines(est: dict[str, Any]) -> list[str]:
    mem = est["memory_bytes_per_rank"]
    gpu = est["assumptions"]["gpu"]
    lines = [f"{'memory per rank':<18}{'GiB':>10}"]
    for key in ("params", "grads", "optimizer", "activations", "buffers", "reserve", "total"):
        lines.append(f"  {key:<16}{mem[key] / GiB:>10.2f}")
    verdict = "fits" if est["fits"] else "does NOT fit"
    lines.append(f"  {verdict} in {gpu['name']} ({gpu['hbm_gib']:.0f} GiB, "
                 f"{est['assumptions']['usable_hbm_fraction']:.0%} usable); worst pp rank "
                 f"{est['worst_pp_rank']}")
    per_rank = est.get("memory_bytes_per_pp_rank", [])
    if len(per_rank) > 1:
        lines.append("  by pp rank: " + " ".join(f"{b / GiB:.1f}" for b in per_rank))
    return lines


def time_lines(est: dict[str, Any]) -> list[str]:
    b = est["breakdown_s"]
    lines = [f"{'step time':<18}{'s':>10}", f"  {'compute':<16}{b['compute']:>10.3f}"]
    for axis, t in sorted(b["exposed_comm"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {'comm ' + axis:<16}{t:>10.3f}")
    lines.append(f"  {'pipeline bubble':<16}{b['pipeline_bubble']:>10.3f}")
    lines.append(f"  {'optimizer':<16}{b['optimizer']:>10.3f}")
    lines.append(f"  {'total':<16}{est['step_time_s']:>10.3f}")
    lines.append(f"{est['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU {est['mfu']:.1%} "
                 f"({est['microbatches']} micro-batch(es) of {est['micro_batch_size']})")
    return lines


def caveat_lines(est: dict[str, Any]) -> list[str]:
    """What the estimate's time rests on that no published run confirms."""
    eff = est["assumptions"]
    curve, lines = eff["efficiency_curve"], []
    if not curve["calibrated_on_this_gpu"]:
        lines.append(f"efficiency: no published run on {eff['gpu']['name']} is fitted; its "
                     f"matmuls and attention are priced with {curve['priced_as']}'s constants "
                     "(README, How accurate)")
    held = curve.get("held_out")
    if held and eff["model"]["step_time_validated"]:
        lines.append(f"accuracy: the {held['runs']} published runs held out of the fit that "
                     f"{curve['priced_as']}'s constants price are off by {held['mape']:.1%} on "
                     f"average ({held['lowest']:+.0%} to {held['highest']:+.0%}) from their "
                     "measured step times (README, How accurate)")
    if not eff["model"]["step_time_validated"]:
        lines.append("mixture of experts: the step time is not validated for shardgraph's ep "
                     "(torch's all-to-all, timed on no GPU); Megatron-Bridge 26.06's and NeMo "
                     "AutoModel's MoE runs (HybridEP's and DeepEP's dispatchers) took 0.95 to "
                     "1.06 times the time priced, Megatron-Bridge 25.11's (the all-to-all "
                     "dispatcher) 2 to 4.2 times where each ep group sat in a node, 0.9 times "
                     "where ep crossed nodes: the dispatcher's code, not the FLOPs, set those "
                     "(README, How accurate)")
    return lines


def render_estimate(est: dict[str, Any]) -> str:
    s = est["sizes"]
    head = "plan: " + (" x ".join(f"{k} {v}" for k, v in s.items() if v > 1) or "one GPU")
    eff = est["assumptions"]
    lines = [head, "", *memory_lines(est), "", *time_lines(est), "",
             f"assumptions: {eff['gpu']['name']} {eff['gpu']['peak_bf16_tflops']:.0f} "
             f"TFLOP/s bf16, matmul efficiency {eff['matmul_efficiency']:.0%}, NVLink "
             f"{eff['gpu']['intra_node_gbps']:.0f} GB/s among {eff['gpu']['gpus_per_node']} "
             f"GPUs, network {eff['gpu']['network_gbps']:.0f} GB/s per GPU"]
    lines += caveat_lines(est)
    if eff.get("adapters"):
        lora = eff["adapters"]
        lines.append(f"LoRA: rank {lora['rank']} adapters beside {', '.join(lora['on'])} in every "
                     f"block{', dropout on their inputs' if lora['dropout'] else ''} (read from "
                     "the targets on the Llama family's names; names it does not know are "
                     "priced as every linear)")
    return "\n".join(lines)


def render_candidates(result: dict[str, Any]) -> str:
    rows = result["candidates"]
    lines = [f"{'#':>2}  {'tokens/s/GPU':>12}  {'MFU':>6}  {'step s':>8}  {'GiB/rank':>8}  plan"]
    for i, r in enumerate(rows, start=1):
        lines.append(f"{i:>2}  {r['tokens_per_s_per_gpu']:>12,.0f}  {r['mfu']:>6.1%}  "
                     f"{r['step_time_s']:>8.3f}  "
                     f"{r['memory_bytes_per_rank']['total'] / 2**30:>8.1f}  {r['summary']}")
    c = result["searched"]
    lines += ["", f"searched {c['layouts']} layouts, estimated {c['estimated']} plans, "
              f"{c['fit']} fit; compiled {c['compiled']} (refused {c['refused']}) in "
              f"{c.get('seconds', 0):.2f} s"]
    if result.get("local_batch"):
        n, dp = result["local_batch"]["size"], result["local_batch"]["dp"]
        lines.append(f"the file fixes the local batch at {n} ({result['local_batch']['key']}), "
                     f"so dp = global_batch_size / {n} = {n * dp} / {n} = {dp}: only layouts "
                     f"with dp = {dp} are searched")
    if result.get("dp_size"):
        fixed = result["dp_size"]
        lines.append(f"the file fixes dp at {fixed['size']} ({fixed['key']}): only layouts with "
                     f"dp = {fixed['size']} are searched")
    if result.get("replaced_sizes"):
        given = ", ".join(f"{k} = {v}" for k, v in result["replaced_sizes"].items())
        lines.append(f"the search chooses the model-parallel sizes: each plan has its own, not "
                     f"the file's {given}")
    lines += ["", "best plan:"]
    best = rows[0]
    lines += ["  " + line for line in _toml(best, result.get("form"),
                                            result.get("dp_size")).splitlines()]
    lines += ["", *memory_lines(best), "", *time_lines(best), *caveat_lines(best)]
    if result["why"]:
        lines += ["", "why:", *("  " + w for w in result["why"])]
    if result.get("software"):
        lines += ["", "beyond the layout:", *("  " + s["why"] for s in result["software"])]
        if result.get("form") == "distributed":
            lines.append("  (each needs the file in the [plugins.*] form: [distributed] has no "
                         "key for them)")
    return "\n".join(lines)


def _toml(row: dict[str, Any], form: str | None = None,
          dp_size: dict[str, Any] | None = None) -> str:
    """The row's plan as TOML, in the file's form: ``[plugins.*]`` tables, or the
    ``[distributed]`` ones a file in that form reads back (``graphs.toml.distributed_form``;
    where the plan has no such spelling, the graph form and why)."""
    out = []
    tables = dict(row["pipeline"]["plugins"])
    written, why = distributed_form(tables, dp_size=dp_size and dp_size["size"]) \
        if form == "distributed" else (None, "")
    if why:
        out.append(f"# in the [plugins] form: {why}")
    out += _tables(written) if written is not None else _tables(tables, "plugins.")
    out.append("[mesh]")
    out += [f"{k} = {v}" for k, v in row["pipeline"]["mesh"].items()]
    if "train" in row:
        out.append(f"# and in [train]: micro_batch_size = {row['train']['micro_batch_size']}")
    return "\n".join(out)


def _tables(tables: dict[str, Any], prefix: str = "") -> list[str]:
    """Nested tables as TOML: each table's own keys, then its sub-tables."""
    out = []
    for name, table in tables.items():
        out.append(f"[{prefix}{name}]")
        out += [f"{k} = {_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
        out += _tables({k: v for k, v in table.items() if isinstance(v, dict)},
                       f"{prefix}{name}.")
    return out


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return str(v)
