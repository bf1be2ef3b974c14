"""Shared fixtures: the offline kit (:mod:`rlhf_trainers.testing`)."""

from __future__ import annotations

import pytest

from rlhf_trainers.testing import OfflineKit, get_kit


@pytest.fixture(scope="session")
def kit() -> OfflineKit:
    """The offline kit from the default cache folder (built on first use, 10-15 s on 2 CPU cores)."""
    return get_kit()
