"""A sandbox's env is stored sealed (console/sealing.py); rows written before are sealed here."""

from typing import Any

from django.db import migrations

import console.sealing


def seal_what_is_there(apps: Any, schema_editor: Any) -> None:
    Sandbox = apps.get_model("sandboxes", "Sandbox")
    for pk, env in Sandbox.objects.values_list("pk", "env").iterator(chunk_size=2000):
        if env:  # read as plain JSON (written before sealing), written back sealed
            Sandbox.objects.filter(pk=pk).update(env=env)


class Migration(migrations.Migration):
    dependencies = [
        ("sandboxes", "0004_snapshot_without_deleting"),
    ]

    operations = [
        migrations.AlterField(
            model_name="sandbox",
            name="env",
            field=console.sealing.SealedJSONField(blank=True, default=dict),
        ),
        migrations.RunPython(seal_what_is_there, migrations.RunPython.noop),
    ]
