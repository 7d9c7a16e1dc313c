"""The Celery app of the effects tests' workers (``tests.reliability.effects_tools``)."""

from __future__ import annotations

from celery import Celery

from saga import Saga
from tests.reliability.effects_tools import tools

app = Celery("saga-effects")
app.config_from_object("celeryconfig")
saga = Saga(app, tools)
