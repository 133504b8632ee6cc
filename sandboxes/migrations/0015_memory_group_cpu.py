from django.db import migrations, models


class Migration(migrations.Migration):
    """A launch may put its memory groups' CPU quota on each group ("group") instead of each sandbox ("each")."""

    dependencies = [
        ("sandboxes", "0014_disk_mib"),
    ]

    operations = [
        migrations.AddField(
            model_name="launch",
            name="memory_group_cpu",
            field=models.CharField(choices=[("each", "Each"), ("group", "Group")], default="each", max_length=5),
        ),
        migrations.AddField(
            model_name="sandbox",
            name="memory_group_cpu",
            field=models.FloatField(default=0.0),
        ),
    ]
