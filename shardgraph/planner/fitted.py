"""The constants every estimate uses: what ``calibration.fit()`` finds on the ``fit`` rows of
``published.toml`` (regenerate: ``python -m shardgraph.planner.calibration``;
``tests/test_planner_validation.py`` checks that no grid neighbour fits better)."""

from __future__ import annotations

from .cost import Efficiency

FITTED = Efficiency(e_max=(("A100-80GB", 0.67), ("H100-SXM", 0.55), ("H100-SXM-500W", 0.4)),
                    x0=100.0, comm_eff=0.8, elementwise=0.5, eager=6.0)
