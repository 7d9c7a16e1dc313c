"""Glue to tools around Celery that saga's deployment uses (Flower)."""
