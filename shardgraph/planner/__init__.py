"""Plan before the cluster: predicted memory per rank and step time of a plan (``estimate``),
and the best plans for a model and a world (``autoplan``). Arithmetic only: neither torch nor
transformers is imported.

Modules: ``gpus`` (presets, ``[cluster]``), ``shape`` (the model's parameters from its config),
``view`` (what a compiled plan does, folded from the ``cost`` records its plugins declare:
``core.costs``), ``memory``, ``activations`` (what a block keeps per token), ``schedule`` (how pp's
schedules order a rank's passes; their bubble), ``flops`` (what a step computes and moves),
``cost`` (its time: efficiency, collectives, overlap), ``predict`` (one plan), ``search`` (every
plan), ``space`` (the layouts it walks), ``fixed`` (what a file fixes of dp that no layout has),
``fitted`` (the constants), ``calibration`` (their fit), ``published`` (the measurements of
``published.toml`` as rows), ``render`` (the text), ``cli`` (the commands).
The planner imports no plugin module, no training code and, but for ``cli``, no command line.
"""

from .cost import Efficiency
from .gpus import GPU, PRESETS
from .predict import estimate
from .search import autoplan

__all__ = ["GPU", "PRESETS", "Efficiency", "autoplan", "estimate"]
