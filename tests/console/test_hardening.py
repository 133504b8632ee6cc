"""What a deployer expects of the console's responses and files: a content policy, private data."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from django.conf import settings
from django.test import Client

from tests.console.conftest import World


def test_pages_carry_a_content_security_policy(member_client: Client, world: World) -> None:
    policy = member_client.get("/").headers["Content-Security-Policy"]
    assert "default-src 'self'" in policy and "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "unsafe-eval" not in policy


def test_the_data_directory_and_its_database_are_the_control_planes_alone(db: None) -> None:
    data = Path(settings.DATA_DIR)
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    for path in data.iterdir():
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, f"{path} is readable by others"


def test_sqlite_zeroes_what_it_deletes(db: None) -> None:
    from django.db import connection

    if connection.vendor != "sqlite":
        pytest.skip("SQLite's own settings: PostgreSQL has none of them")
    with connection.cursor() as cursor:
        assert cursor.execute("PRAGMA secure_delete").fetchone()[0] == 1
        assert cursor.execute("PRAGMA journal_size_limit").fetchone()[0] == 0
