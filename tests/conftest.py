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


@pytest.fixture(autouse=True, scope="session")
def _transformers_log_stream():
    """transformers' log handler writes to the ``sys.stderr`` of its first message: made here,
    outside any test, not inside one whose ``capsys`` stream closes after it (a later test's
    warning then printed "--- Logging error ---" and a traceback into that test's output)."""
    from transformers.utils import logging

    logging.get_logger("transformers")
