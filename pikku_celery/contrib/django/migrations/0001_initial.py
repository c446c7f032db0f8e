"""The start intents table (``models.StartIntent``)."""

import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.CreateModel(
            name="StartIntent",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True,
                                           serialize=False, verbose_name="ID")),
                ("run_id", models.CharField(db_index=True, max_length=200)),
                ("workflow", models.CharField(max_length=200)),
                ("data", models.TextField(help_text="the run's input as JSON text")),
                ("created", models.DateTimeField(db_index=True,
                                                 default=django.utils.timezone.now)),
                ("attempts", models.PositiveIntegerField(default=0)),
                ("last_error", models.TextField(blank=True, default="")),
                ("refused", models.BooleanField(default=False)),
            ],
            options={
                "verbose_name": "start intent",
                "db_table": "pikku_start_intent",
                "ordering": ["created", "id"],
            },
        ),
    ]
