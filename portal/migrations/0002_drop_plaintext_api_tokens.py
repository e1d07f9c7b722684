# Personal API tokens moved from DRF's authtoken (the token itself stored in plain text) to django-rest-knox
# (a SHA-512 digest and an expiry). The old table is dropped so no plaintext credential stays behind; those
# tokens stop working and their owners make new ones (POST /api/auth/token/ or the portal's token page).

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("portal", "0001_initial")]

    operations = [
        migrations.RunSQL("DROP TABLE IF EXISTS authtoken_token CASCADE", reverse_sql=migrations.RunSQL.noop),
    ]
