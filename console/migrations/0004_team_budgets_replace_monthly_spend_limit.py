# The team's monthly limit lives in billing.Budget now (copied there by billing's 0004).

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("console", "0003_api_key_scopes_and_audit_log"),
        ("billing", "0004_budgets_statements_and_metered_usage"),
    ]

    operations = [
        migrations.RemoveField(model_name="teamlimits", name="monthly_spend_limit"),
    ]
