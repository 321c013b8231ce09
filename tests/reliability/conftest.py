"""Fixtures of the reliability tests."""
from __future__ import annotations

import pytest

from tests.reliability.own_postgres import OwnPostgres


@pytest.fixture
def own_postgres():
    """A private PostgreSQL server the test may stop and start (see own_postgres.py)."""
    server = OwnPostgres()
    try:
        yield server
    finally:
        server.close()
