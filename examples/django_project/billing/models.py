"""One model, written by the ``invoice.charge`` handler."""

from __future__ import annotations

from django.db import models


class Invoice(models.Model):
    number = models.CharField(max_length=32, unique=True)
    amount = models.DecimalField(max_digits=12, decimal_places=2)
    paid = models.BooleanField(default=False)
    charged_at = models.DateTimeField(null=True)

    class Meta:
        app_label = "billing"

    def __str__(self) -> str:
        return self.number
