"""The Celery app the worker runs (``celery -A tasks.app worker``) and the ``saga`` that the
web app or agent loop imports to start runs; it hosts the demo's ``refund`` agent."""

from __future__ import annotations

from celery import Celery

from saga import Saga
from tasks import agents
from tasks.tools import tools

app = Celery("saga-demo")
app.config_from_object("celeryconfig")

saga = Saga(app, tools)
agents.declare(saga)
