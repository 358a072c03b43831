"""``python -m shardgraph.train ARGS`` is ``shardgraph ARGS``: what a torchrun started by hand
runs per rank (``-m shardgraph.cli`` would load the CLI module twice, once as ``__main__``)."""

import sys

from ..cli import main

if __name__ == "__main__":  # not where a spawned worker imports its launcher's main module
    sys.exit(main())
