"""An app that registers a tool after its ``Saga`` is built, as a module may when its tools
live further down (or in a module imported after the app's): the late-registration tests'
worker runs it, on a queue of its own so the session's demo worker never takes its messages.
"""

from __future__ import annotations

from celery import Celery

from saga import Saga, StepContext, ToolClass, ToolRegistry

QUEUE = "late_tools"
tools = ToolRegistry()


@tools.tool(ToolClass.READ)
def early(ctx: StepContext, n: int) -> dict[str, int]:
    return {"early": n}


app = Celery("late_tools")
app.config_from_object("saga.celery_defaults")
app.conf.task_default_queue = QUEUE
saga = Saga(app, tools)


@tools.tool(ToolClass.READ)
def registered_late(ctx: StepContext, n: int) -> dict[str, int]:
    return {"late": n}
