"""Messages of optional libraries that tell a shardgraph user nothing they can act on, dropped
where they are logged:

- torchao (installed for float8; transformers imports it whenever it is installed) loads its
  CUDA kernel libraries on import and logs a warning for each one a machine without CUDA cannot
  load: on a CPU machine, every command that builds a model said so twice per process;
- torch logs a deprecation for each Enum that torchao registers with pytree (torchao's to
  change, not the user's);
- torch's distributed checkpoint warns that it loads or saves in one process when no process
  group is up, and logs it again when it consolidates safetensors: what a one-process run or
  ``export --nproc 1`` asks of it.

Importing this module installs the filters (the command line does, and the fork server its
workers come from imports it first); ``install`` again is a no-op. Any other message of these
loggers passes, and torchao's on a machine with CUDA.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings

#: (logger, the start of a message it drops on a machine without CUDA)
NO_CUDA = (("torchao", "Failed to load "),)
#: (logger, a part of a message it drops everywhere)
ALWAYS = (("torch.utils._pytree",
           "Calling register_constant() on Enum subclasses is deprecated"),
          ("torch.distributed.checkpoint._consolidate_hf_safetensors",
           "Distributed environment not initialized. Running in single process mode"))
#: the start of a warning (``warnings``) dropped everywhere
WARNINGS = ("torch.distributed is disabled, unavailable or uninitialized, assuming the intent "
            "is to",)


class _Drop(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(record.name == name and part in message for name, part in ALWAYS):
            return False
        return not any(record.name == name and message.startswith(start)
                       for name, start in NO_CUDA) or _cuda()


def _cuda() -> bool:
    torch = sys.modules.get("torch")  # the libraries that log these have imported it
    return torch is not None and torch.cuda.is_available()


def install() -> None:
    for name in {name for name, _ in NO_CUDA + ALWAYS}:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop())
    for start in WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(start), category=UserWarning)


install()
