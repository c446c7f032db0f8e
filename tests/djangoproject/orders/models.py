from django.db import models


class Order(models.Model):
    sku = models.CharField(max_length=50)
    quantity = models.IntegerField()
    run_id = models.CharField(max_length=64, blank=True)
