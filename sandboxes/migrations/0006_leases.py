"""Leases: sandboxes and launches that name one die when its heartbeats stop."""

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models

import sandboxes.models


class Migration(migrations.Migration):
    dependencies = [
        ("console", "0002_alter_teamlimits_burst_and_more"),
        ("sandboxes", "0005_sealed_env"),
    ]

    operations = [
        migrations.CreateModel(
            name="Lease",
            fields=[
                (
                    "id",
                    models.CharField(
                        default=sandboxes.models.lease_id, editable=False, max_length=32, primary_key=True, serialize=False
                    ),
                ),
                ("grace_s", models.PositiveIntegerField()),
                (
                    "state",
                    models.CharField(
                        choices=[("active", "Active"), ("expired", "Expired"), ("ended", "Ended")],
                        default="active",
                        max_length=10,
                    ),
                ),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("heartbeat_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("expires_at", models.DateTimeField()),
                ("ended_at", models.DateTimeField(blank=True, null=True)),
                (
                    "api_key",
                    models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, to="console.apikey"),
                ),
                (
                    "team",
                    models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="leases", to="console.team"),
                ),
            ],
        ),
        migrations.AddField(
            model_name="launch",
            name="lease",
            field=models.ForeignKey(
                blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name="launches", to="sandboxes.lease"
            ),
        ),
        migrations.AddField(
            model_name="sandbox",
            name="lease",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="sandboxes",
                to="sandboxes.lease",
            ),
        ),
        migrations.AddIndex(
            model_name="lease",
            index=models.Index(fields=["state", "expires_at"], name="sandboxes_l_state_77afe5_idx"),
        ),
        migrations.AddIndex(
            model_name="lease",
            index=models.Index(fields=["team", "created_at"], name="sandboxes_l_team_id_242bf2_idx"),
        ),
    ]
