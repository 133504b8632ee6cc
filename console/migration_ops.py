"""Operations our migrations share.

``AlterField(db_index=False)`` on a foreign key drops every index PostgreSQL
reports on that one column, unique ones included: the partial unique index
that keeps one open billing period per sandbox went with the key's own.
Migrations that take a key's index away change the field in the state only
and drop, here, exactly the plain indexes the key had.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import migrations


def drop_plain_indexes(table: str, columns: Sequence[str]) -> migrations.RunPython:
    """Drop the non-unique one-column indexes of ``columns`` (Django's for a key, and on PostgreSQL its
    ``varchar_pattern_ops`` twin), leaving unique, partial-unique and many-column ones alone."""

    def run(apps: Any, schema_editor: Any) -> None:
        connection = schema_editor.connection
        with connection.cursor() as cursor:
            found = connection.introspection.get_constraints(cursor, table)
        for name, info in sorted(found.items()):
            if (
                info["index"]
                and not info["unique"]
                and not info["primary_key"]
                and len(info["columns"]) == 1
                and info["columns"][0] in columns
            ):
                schema_editor.execute(f"DROP INDEX {schema_editor.quote_name(name)}")

    # Back: nothing. The indexes were for speed only; none is needed back.
    return migrations.RunPython(run, migrations.RunPython.noop)
