"""Composite foreign keys that keep denormalised tenant and team columns consistent with their parents.

Django has no composite foreign keys, so they are declared in SQL. With PostgreSQL's MATCH SIMPLE a row
whose team (or key) is NULL is not checked, which is what operator memberships and team quotas need.
"""

from django.db import migrations

FOREIGN_KEYS = [
    # (table, constraint, columns, referenced table, referenced columns)
    (
        "tenants_membership",
        "membership_team_in_tenant",
        "team_id, tenant_id",
        "tenants_team",
        "id, tenant_id",
    ),
    ("tenants_quota", "quota_key_in_team", "api_key_id, team_id", "tenants_apikey", "id, team_id"),
    ("tenants_usagerecord", "usage_team_in_tenant", "team_id, tenant_id", "tenants_team", "id, tenant_id"),
    ("tenants_usagerecord", "usage_key_in_team", "api_key_id, team_id", "tenants_apikey", "id, team_id"),
]


def _on_delete(table: str) -> str:
    return "ON DELETE CASCADE" if table in ("tenants_membership", "tenants_quota") else ""


class Migration(migrations.Migration):
    dependencies = [("tenants", "0001_initial")]

    operations = [
        migrations.RunSQL(
            sql=(
                f"ALTER TABLE {table} ADD CONSTRAINT {name} FOREIGN KEY ({cols}) "
                f"REFERENCES {ref} ({ref_cols}) {_on_delete(table)} DEFERRABLE INITIALLY DEFERRED;"
            ),
            reverse_sql=f"ALTER TABLE {table} DROP CONSTRAINT {name};",
        )
        for table, name, cols, ref, ref_cols in FOREIGN_KEYS
    ]
