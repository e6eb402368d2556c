"""The billing app's Orbit handlers, found by ``manage.py orbit_worker`` (the module's name is
the convention: ``<app>/orbit_tasks.py``)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.db import transaction
from django.utils import timezone

from orbit_sync.contrib.django import handler
from orbit_sync.worker import Fail, TaskContext

from .models import Invoice


@handler("invoice.charge")
def charge(ctx: TaskContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Record the invoice as charged, once: a retried attempt finds it paid and changes nothing."""
    try:
        amount = Decimal(payload["amount"])
    except (KeyError, ArithmeticError, TypeError):
        raise Fail("BAD_PAYLOAD", "amount must be a decimal string", retryable=False) from None
    with transaction.atomic():
        invoice, _ = Invoice.objects.get_or_create(
            number=payload["number"], defaults={"amount": amount}
        )
        if not invoice.paid:
            invoice.paid = True
            invoice.charged_at = timezone.now()
            invoice.save(update_fields=["paid", "charged_at"])
    # A datetime and a Decimal: the worker's result converter encodes them (RFC 3339, string).
    return {"number": invoice.number, "amount": invoice.amount, "charged_at": invoice.charged_at}
