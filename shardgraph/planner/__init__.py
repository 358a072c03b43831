"""Plan before the cluster: predicted memory per rank and step time of a plan (``estimate``),
and the best plans for a model and a world (``autoplan``). Arithmetic only: neither torch nor
transformers is imported.

Modules: ``gpus`` (presets, ``[cluster]``), ``shape`` (the model's parameters from its config),
``view`` (what a compiled plan does, read from its steps' capabilities), ``memory``, ``cost``
(FLOPs, collectives, bubble), ``predict`` (one plan), ``search`` (every plan),
``calibration`` (fitted constants; ``published.toml`` holds the measurements).
"""

from .cost import Efficiency
from .gpus import GPU, PRESETS
from .predict import estimate
from .search import autoplan

__all__ = ["GPU", "PRESETS", "Efficiency", "autoplan", "estimate"]
