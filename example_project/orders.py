"""An order workflow: reserve stock (with a compensation), charge a flaky payment provider
(retried), allocate a courier (slow), notify the customer on two channels in parallel,
wait for the parcel to be picked, ship."""

from __future__ import annotations

import random
from typing import Any

from example_project import settings
from example_project.celery_app import pikku
from pikku_celery import StepContext, WorkflowContext


@pikku.step(retries=2)
def reserve_inventory(data: dict[str, Any]) -> dict[str, Any]:
    return {"reservation": f"res-{data['order_id']}", "items": data["items"]}


@pikku.step(retries=3)
def release_inventory(data: dict[str, Any]) -> dict[str, Any]:
    """Compensation: runs once when the charge failed for good."""
    return {"released": data["data"]["order_id"], "because": data["error"]["message"]}


class PaymentDeclined(Exception):
    pass


@pikku.step(retries=3, retry_delay="200ms", bind=True, no_retry_for=(PaymentDeclined,))
def charge_payment(ctx: StepContext, data: dict[str, Any]) -> dict[str, Any]:
    # The invocation id is the same on every attempt: the payment provider's idempotency
    # key, so a retried or duplicated charge is never taken twice.
    if data["card"] == "declined":
        raise PaymentDeclined(f"card declined for order {data['order_id']}")
    if ctx.attempt == 1 and random.random() < 0.5:
        raise ConnectionError("payment provider timed out")
    return {"charge_id": f"ch-{ctx.invocation_id[:8]}", "amount": data["amount"]}


@pikku.step(retries=3, bind=True)
def allocate_courier(ctx: StepContext, data: dict[str, Any]) -> dict[str, Any]:
    ctx.wait_lost(settings.COURIER_SECONDS)  # a slow call to the courier API
    return {"courier": f"courier-{ctx.attempt}", "order_id": data["order_id"]}


@pikku.step(retries=3)  # the demo kills workers mid-step: run it again
def send_email(data: dict[str, Any]) -> str:
    return f"email sent for {data['order_id']}"


@pikku.step(retries=3)
def send_sms(data: dict[str, Any]) -> str:
    return f"sms sent for {data['order_id']}"


@pikku.step(retries=3)
def ship(data: dict[str, Any]) -> dict[str, Any]:
    return {"shipped": data["order_id"], "courier": data["courier"]}


@pikku.workflow("order")
def order_workflow(wf: WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
    reservation = wf.do("reserve", reserve_inventory, order)
    # If the charge fails for good, the reservation is released (once), then the run fails.
    charge = wf.do("charge", charge_payment, order, on_error=release_inventory)
    courier = wf.do("courier", allocate_courier, order)
    email, sms = wf.gather(wf.call("email", send_email, order), wf.call("sms", send_sms, order))
    wf.sleep("await-pickup", "100ms")
    shipment = wf.do("ship", ship, {"order_id": order["order_id"], **courier})
    return {"reservation": reservation, "charge": charge, "shipment": shipment,
            "notified": [email, sms]}
