import json

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_POST
from djproj.celery import pikku

from orders.models import Order


@require_POST
def create_order(request: HttpRequest) -> JsonResponse:
    """Saves an order and starts its workflow once the order is committed; ``fail`` makes
    the transaction roll back after the run was asked for."""
    body = json.loads(request.body)
    with transaction.atomic():
        order = Order.objects.create(sku=body["sku"], quantity=body["quantity"])
        order.run_id = pikku.start_on_commit(
            "order", {"order_id": order.pk, "sku": order.sku, "quantity": order.quantity})
        order.save(update_fields=["run_id"])
        if body.get("fail"):
            raise RuntimeError("payment provider said no")
    return JsonResponse({"order_id": order.pk, "run_id": order.run_id}, status=201)
