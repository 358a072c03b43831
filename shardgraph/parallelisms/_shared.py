"""Helpers several plugins use, so none imports another's module: a shared layer between
the plugins (``parallelisms/*``, ``strategies/*``) and ``core/``. It imports no plugin module
(``tests/test_architecture.py``); torch loads with it, so a declaration never imports it."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import SequenceParallel


class KeepFrozenSequenceParallel(SequenceParallel):
    """``SequenceParallel`` that keeps each parameter's ``requires_grad``: torch's replicates a
    norm's weight into a new, trainable ``nn.Parameter``, which would train the frozen norms of
    a LoRA model. tp puts it on the norms it keeps whole under sp, sp on the rest."""

    def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh):
        frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
        super()._replicate_module_fn(name, module, device_mesh)
        for n, p in module.named_parameters():
            if n in frozen:
                p.requires_grad_(False)
