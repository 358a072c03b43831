"""``python -m shardgraph ARGS`` is ``shardgraph ARGS`` (as ``python -m shardgraph.train``)."""

import sys

from .cli import main

if __name__ == "__main__":  # not where a spawned worker imports its launcher's main module
    sys.exit(main())
