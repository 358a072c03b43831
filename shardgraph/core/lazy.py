"""A module that is imported on first attribute access.

A plugin's declaration is read by every command (``plan``, ``explain``, ``plugins``), its
runtime only when a plan is applied. A plugin module binds its torch-heavy private helpers
with ``lazy_module`` so that reading the declaration imports no torch.

This is a plain proxy, not ``importlib.util.LazyLoader``: a lazy module object sitting in
``sys.modules`` is executed by whatever touches it first, and torch's own import scans
``sys.modules`` (a half-imported torch then warns that dynamo is unavailable).
"""

from __future__ import annotations

import importlib
from typing import Any


class lazy_module:  # noqa: N801 - used like the module it stands for
    """``lazy_module("pkg.mod").name`` imports ``pkg.mod`` (once) and reads ``name``."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"
