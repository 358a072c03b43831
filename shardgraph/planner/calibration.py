"""The efficiency constants every estimate uses, fitted by ``fit`` on the rows of
``published.toml`` marked ``split = "fit"`` (``tests/test_planner_validation.py`` refits them and
reports the error on the other rows)."""

from __future__ import annotations

from .cost import Efficiency

FITTED = Efficiency()
