from django.contrib import admin

from .models import AcceleratorPrice, CommercialPrice


@admin.register(AcceleratorPrice)
class AcceleratorPriceAdmin(admin.ModelAdmin):
    list_display = ["accelerator", "price_per_gpu_hour", "currency"]


@admin.register(CommercialPrice)
class CommercialPriceAdmin(admin.ModelAdmin):
    list_display = ["name", "input_per_mtok", "cached_input_per_mtok", "output_per_mtok", "currency", "as_of"]
