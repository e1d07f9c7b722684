"""Daily roll-ups per priority class as well, so that reports can group by it.

The rows rolled up so far hold no class: they are thrown away and the watermark goes back to 0, so that the
worker's next roll-ups (every minute, a million records a batch) add the whole ledger up again, by class. Reports
stay exact meanwhile: they read the ledger for every record above the watermark.
"""

from django.db import migrations, models


def _roll_up_again(apps, schema_editor):
    apps.get_model("tenants", "UsageDaily").objects.all().delete()
    apps.get_model("tenants", "UsageRollupState").objects.update(last_record_id=0)


class Migration(migrations.Migration):
    dependencies = [
        ("tenants", "0009_ceilings_pooled"),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name="usagedaily",
            name="usage_daily_one_row_per_group",
        ),
        migrations.AddField(
            model_name="usagedaily",
            name="priority_class",
            field=models.CharField(
                blank=True,
                choices=[("interactive", "Interactive"), ("standard", "Standard"), ("batch", "Batch")],
                db_default="",
                default="",
                max_length=12,
            ),
        ),
        migrations.AddConstraint(
            model_name="usagedaily",
            constraint=models.UniqueConstraint(
                fields=(
                    "day",
                    "tenant",
                    "team",
                    "api_key",
                    "deployment_id",
                    "model",
                    "priority_class",
                    "currency",
                ),
                name="usage_daily_one_row_per_group",
                nulls_distinct=False,
            ),
        ),
        migrations.RunPython(_roll_up_again, migrations.RunPython.noop),
    ]
