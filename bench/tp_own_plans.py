"""What tp resolves from each transformers causal-LM class's own plan, and how two checkouts
differ: every class ``AutoModelForCausalLM`` maps and every ``*ForCausalLM`` built from its
config's defaults (or train's tiny ones) on the meta device, layers cut to 2 where the config
allows; per class the plan ``model_plan`` reads, each entry's origin, the modules it matches
and the rules tp's checks break at tp 2.

With ``--base DIR`` (another checkout or a worktree, e.g. ``git worktree add ../base HEAD~1``)
both are read, each in a fresh process, and the classes whose plan, origins, matched modules
or problems differ are listed; a class neither builds is listed as skipped.

    python bench/tp_own_plans.py [--base DIR] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging
logging.set_verbosity_error()
from shardgraph.parallelisms import tp
from shardgraph.parallelisms.tp import _styles
from shardgraph.train.model import TINY

LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers", "depth")


def cut(config, seen):
    # two layers, and the per-layer lists (layer_types) cut with them
    if id(config) in seen:
        return
    seen.add(id(config))
    for key in LAYERS:
        n = getattr(config, key, None)
        if isinstance(n, int) and n > 2:
            setattr(config, key, 2)
            for name, value in list(vars(config).items()):
                if isinstance(value, list) and len(value) == n:
                    setattr(config, name, value[:2])
    for value in list(vars(config).values()):
        if isinstance(value, transformers.PreTrainedConfig):
            cut(value, seen)


def build(cls):
    errors = []
    for kwargs, cutting in (({}, True), (TINY, True), ({}, False), (TINY, False)):
        try:
            config = cls.config_class(**kwargs)
            if cutting:
                cut(config, set())
            with torch.device("meta"):
                return cls(config), None
        except Exception as exc:  # a class whose defaults do not build: reported, not fatal
            errors.append(f"{type(exc).__name__}: {str(exc).strip()[:120]}")
    return None, errors[0]


names = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
               | {n for n in dir(transformers) if n.endswith("ForCausalLM")} - {"AutoModelForCausalLM"})
only = set(sys.argv[1:])
out = {}
for name in names:
    if only and name not in only:
        continue
    cls = getattr(transformers, name, None)
    model, error = build(cls) if cls is not None else (None, "not exported")
    if model is None:
        out[name] = {"skipped": error}
        continue
    plan, origin = _styles.model_plan(model)
    if not plan:
        out[name] = {"plan": {}}
        continue
    resolved = tp._resolve(model, tp.TPOptions(size=2), 2)
    out[name] = {"plan": plan, "origin": origin, "matched": resolved.matched,
                 "problems": [[v.rule, list(v.keys)] for v in resolved.problems]}
json.dump(out, sys.stdout)
"""


def read(checkout: Path, only: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run([sys.executable, "-c", PROBE, *only], env=env, cwd=checkout,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, help="another checkout to compare with")
    parser.add_argument("--only", nargs="*", default=[], help="these classes alone")
    args = parser.parse_args()
    here = read(ROOT, args.only)
    with_plan = [n for n, r in here.items() if r.get("plan")]
    skipped = {n: r["skipped"] for n, r in here.items() if "skipped" in r}
    print(f"{len(here)} classes: {len(here) - len(skipped)} built, {len(with_plan)} with a plan, "
          f"{sum(1 for n in with_plan if not here[n]['problems'])} of them accepted at tp 2")
    for name, error in skipped.items():
        print(f"  skipped {name}: {error}")
    if args.base is None:
        return
    base = read(args.base, args.only)
    differ = 0
    for name in sorted(here):
        a, b = base.get(name, {}), here[name]
        if "skipped" in a or "skipped" in b or a == b:
            continue
        differ += 1
        print(f"{name}:")
        for key in ("plan", "origin", "matched"):
            old, new = a.get(key) or {}, b.get(key) or {}
            added = sorted(set(new) - set(old))
            removed = sorted(set(old) - set(new))
            changed = sorted(k for k in set(old) & set(new) if old[k] != new[k])
            if added or removed or changed:
                print(f"  {key}: +{len(added)} {added[:3]} -{len(removed)} {removed[:3]} "
                      f"changed {[(k, old[k], new[k]) for k in changed[:3]]}")
        if a.get("problems") != b.get("problems"):
            print(f"  problems: {a.get('problems')} -> {b.get('problems')}")
    print(f"{differ} of {len(with_plan)} classes with a plan differ from {args.base}")


if __name__ == "__main__":
    main()
