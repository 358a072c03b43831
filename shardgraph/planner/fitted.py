"""The constants every estimate uses: what ``calibration.fit()`` finds on the ``fit`` rows of
``published.toml`` (regenerate: ``python -m shardgraph.planner.calibration``;
``tests/test_planner_validation.py`` checks that no grid neighbour fits better)."""

from __future__ import annotations

from .cost import Efficiency

FITTED = Efficiency(e_max=(("A100-80GB", 0.7), ("H100-SXM", 0.64), ("H100-SXM-500W", 0.44)),
                    x0=200.0, comm_eff=0.9, elementwise=0.5, eager=6.0, overlap=0.4)
