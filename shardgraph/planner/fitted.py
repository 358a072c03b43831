"""The constants every estimate uses: what ``calibration.fit()`` finds on the ``fit`` rows of
``published.toml`` (regenerate: ``python -m shardgraph.planner.calibration``;
``tests/test_planner_validation.py`` checks that no grid neighbour fits better), and what they
price the held-out rows at (``HELD_OUT``: ``calibration.held_out()``, checked equal)."""

from __future__ import annotations

from .cost import Efficiency

FITTED = Efficiency(e_max=(("A100-80GB", 0.76), ("A100-40GB-MPT", 0.77), ("A100-80GB-MPT", 0.81),
                           ("B200", 0.56), ("H100-SXM", 0.64), ("H100-SXM-500W", 0.62),
                           ("H100-SXM-TE", 0.81), ("H100-SXM-TE-24.03", 0.61),
                           ("H100-SXM-MPT", 0.6), ("H200-TE", 0.78)),
                    x0=200.0, k0=256.0, comm_eff=0.9, elementwise=0.5, eager=6.0,
                    overlap=0.4, matmul_overlap=0.7, float8=1.7,
                    attention=(("A100-80GB", 1.0), ("A100-40GB-MPT", 0.4), ("A100-80GB-MPT", 0.4),
                               ("B200", 1.0), ("H100-SXM", 0.9), ("H100-SXM-500W", 0.3),
                               ("H100-SXM-TE", 0.4), ("H100-SXM-TE-24.03", 0.6),
                               ("H100-SXM-MPT", 0.3), ("H200-TE", 0.4)),
                    float8_attention=1.13)

#: per constants' name that prices a GPU preset: the held-out published step times of dense
#: models priced with them, (runs, mean absolute error, lowest error, highest error)
HELD_OUT = {"A100-80GB": (16, 0.032, -0.078, 0.048), "B200": (38, 0.071, -0.262, 0.225),
            "H100-SXM": (10, 0.068, -0.122, 0.116)}
