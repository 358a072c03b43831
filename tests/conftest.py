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


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """This process computes with one thread, as every rank does (``tests/_dist.py``, the
    launcher): its models are tiny, and two intra-op threads on two cores shared with ranks,
    servers and other jobs wait on each other (a one-process reference's 3 steps: ~1 s with
    one thread, 5-10 s with two on a loaded machine). Numbers change at most by float32's
    summation order, which every tolerance here already allows for (ranks run with one)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
