from django.urls import include, path
from orders import views

urlpatterns = [
    path("pikku/", include("pikku_celery.contrib.django.urls")),
    path("orders/", views.create_order, name="create-order"),
]
