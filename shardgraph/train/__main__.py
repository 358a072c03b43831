"""``python -m shardgraph.train ARGS`` is ``shardgraph ARGS``: what a torchrun started by hand
runs per rank (``-m shardgraph.cli`` would load the CLI module twice, once as ``__main__``)."""

import sys

from ..cli import main

sys.exit(main())
