"""Found by pikku's Django app (``INSTALLED_APPS``) in every process, worker included."""

from typing import Any

from djproj.celery import pikku

PRICES = {"tea": 4, "cake": 7}


@pikku.step(name="orders.price")
def price(order: dict[str, Any]) -> int:
    return PRICES[order["sku"]] * int(order["quantity"])


@pikku.step(name="orders.confirm")
def confirm(data: dict[str, Any]) -> str:
    return f"order {data['order_id']}: {data['total']} EUR"


@pikku.workflow("order")
def order(wf: Any, data: dict[str, Any]) -> dict[str, Any]:
    total = wf.do("price", price, data)
    message = wf.do("confirm", confirm, {"order_id": data["order_id"], "total": total})
    return {"total": total, "message": message}
