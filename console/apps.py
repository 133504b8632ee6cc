from pathlib import Path
from typing import Any

from django.apps import AppConfig
from django.db.backends.signals import connection_created


def _private_database_files(sender: Any, connection: Any, **_: Any) -> None:
    """SQLite's files (the database, its write-ahead log and shared memory) are the control plane's alone."""
    if connection.vendor != "sqlite":
        return
    database = Path(str(connection.settings_dict["NAME"]))
    for path in (database, Path(f"{database}-wal"), Path(f"{database}-shm")):
        try:
            path.chmod(0o600)
        except OSError:
            pass  # not made yet, or an in-memory database


class ConsoleConfig(AppConfig):
    name = "console"
    verbose_name = "Accounts and console"

    def ready(self) -> None:
        connection_created.connect(_private_database_files, dispatch_uid="forkyard-private-database-files")
        from django.db.models.signals import post_delete, post_save

        from .keys import forget_keys
        from .models import ApiKey, Team, TeamLimits

        # A key checked a moment ago is trusted for a few seconds (console.keys.RECENT_S): not past a change to it.
        for model in (ApiKey, Team, TeamLimits):
            post_save.connect(forget_keys, sender=model, dispatch_uid=f"forkyard-forget-keys-saved-{model.__name__}")
            post_delete.connect(forget_keys, sender=model, dispatch_uid=f"forkyard-forget-keys-deleted-{model.__name__}")
