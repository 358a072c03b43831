"""The token stream of ``[data]``: deterministic, identical on every rank and under every plan.

Batch ``s`` depends only on ``(seed, s)`` (synthetic) or on the file and ``s`` (a token file),
so a resumed run, or a run under another plan, sees exactly the same sequences. Each rank then
takes its data-parallel slice of the global batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..core.errors import PlanError, Violation
from .config import DataConfig


class TokenStream:
    def __init__(self, spec: DataConfig, vocab_size: int, seed: int):
        self.spec, self.vocab_size, self.seed = spec, vocab_size, seed
        self.tokens: torch.Tensor | None = None
        if spec.path is not None:
            self.tokens = _read(Path(spec.path), spec.token_dtype)
            if self.tokens.numel() < spec.seq_len:
                raise PlanError([Violation(
                    "data", ("data.path",), f"{spec.path} holds {self.tokens.numel()} tokens, "
                    f"fewer than one sequence of {spec.seq_len}", hint="use a longer file")])
            top = int(self.tokens.max())
            if top >= vocab_size:
                raise PlanError([Violation(
                    "data", ("data.path", "model.config.vocab_size"),
                    f"{spec.path} holds token id {top} but the model's vocab_size is "
                    f"{vocab_size}", hint=f"set model.config.vocab_size >= {top + 1}")])

    def batch(self, position: int, count: int) -> torch.Tensor:
        """Sequences ``position .. position + count - 1`` of the stream: ``(count, seq_len)``.

        Sequence ``i`` depends only on ``(seed, i)`` (or on the file), so the stream is the
        same whatever the batch size, the plan or the step a run resumed at.
        """
        seq = self.spec.seq_len
        if self.tokens is None:
            # Arithmetic progressions modulo the vocabulary (random start, stride 1..4): a
            # stream with structure to learn, so the loss falls within a few steps.
            rows = []
            ramp = torch.arange(seq)
            for i in range(position, position + count):
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
                start, stride = torch.randint(0, self.vocab_size, (1,), generator=g), \
                    torch.randint(1, 5, (1,), generator=g)
                rows.append((start + stride * ramp) % self.vocab_size)
            return torch.stack(rows)
        n = self.tokens.numel()
        starts = torch.arange(position, position + count) * seq
        index = (starts[:, None] + torch.arange(seq)[None, :]) % n  # wraps around the file
        return self.tokens[index]


def _read(path: Path, token_dtype: str) -> torch.Tensor:
    if path.suffix == ".txt":
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    elif path.suffix == ".npy":
        data = np.load(path)
    else:
        data = np.fromfile(path, dtype=np.dtype(token_dtype))
    return torch.from_numpy(data.astype(np.int64).reshape(-1))


def local_slice(tokens: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """This rank's contiguous share of the global batch."""
    return tokens.chunk(dp_size)[dp_rank]
