"""Suite-wide settings."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def _token_cache(tmp_path_factory):
    """Tokenised text is cached (``train/data.py``): the suite's goes to a directory of its
    own, not the user's ``~/.cache``; launched processes inherit it."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SHARDGRAPH_CACHE", str(tmp_path_factory.mktemp("token_cache")))
    yield
    mp.undo()
