from django.contrib import admin

from .models import WhatIfRun


@admin.register(WhatIfRun)
class WhatIfRunAdmin(admin.ModelAdmin):
    list_display = ["id", "deployment", "since", "until", "status", "progress", "requested_by", "created_at"]
    list_filter = ["status", "deployment"]
    readonly_fields = ["status", "progress", "stage", "message", "result", "started_at", "finished_at"]
