"""Revoked and killed deliveries: Celery's ``task_revoked`` says a message will not run, or was
terminated while it ran. What that means for the run is decided from its recorded state, not
from Celery's flag: a step one delivery began may have had its effect, and a revoked undo must
still hand the unwind's chain on.
"""

from __future__ import annotations

import logging
from typing import Any

from saga.compensation import send_rest
from saga.constants import TOOL_TASK_PREFIX
from saga.core import Core
from saga.reaper import reconcile
from saga.stack import REVOKE_KILLED

# The workers' logger, whichever of their modules logs: operators and tests match its name.
logger = logging.getLogger("saga.worker")


def on_revoked(core: Core, request: Any, terminated: bool, killed: bool = False) -> None:
    """A revoked message is decided from the recorded state, not from Celery's flag: a step no
    delivery began never ran (failed); one that began is in doubt, reconciled once no delivery
    may still be running it (right away unless its lease holds, else by the reaper)."""
    kwargs = getattr(request, "kwargs", None) or {}
    name = str(getattr(request, "name", "") or getattr(request, "task", ""))
    run_id = kwargs.get("run_id")
    if not name.startswith(TOOL_TASK_PREFIX) or run_id is None:
        return
    error = {"type": "Revoked", "message": f"{name} was revoked (terminated: {terminated})"}
    try:
        if kwargs.get("compensates") is not None:
            _compensation_revoked(core, request, run_id, kwargs, error, killed)
            return
        step = int(kwargs["step"])
        outcome = core.store.mark_in_doubt(run_id, step, error, event="revoke")
        if outcome.owns_unwind:
            core.start_unwind(run_id, f"step:{step}")
        elif outcome.status == "in_doubt" and str(outcome.values[0]) == "0":
            reconcile(core, run_id, step)
        elif outcome.status == "in_doubt":
            # Its delivery may still be applying the effect: the reaper asks the lookup once
            # the lease has run out, not before.
            lease = core.picture(run_id).step(step).lease or core.store.now()
            core.store.schedule(run_id, lease)
    except Exception:
        logger.exception("run %s: could not record the revoke of %s", run_id, name)


def _compensation_revoked(
    core: Core,
    request: Any,
    run_id: str,
    kwargs: dict[str, Any],
    error: dict[str, Any],
    killed: bool,
) -> None:
    """Fenced by the unwind's owner: a revoke of a stale chain's message changes nothing. An
    execution killed by SIGKILL is gone: its lease ends with it; any other revoked execution
    may still be undoing, and keeps its lease until it reports."""
    step, unwind = int(kwargs["compensates"]), str(kwargs.get("unwind") or "")
    claim = REVOKE_KILLED if killed else ""
    outcome = core.store.record_compensation(
        run_id, step, "revoke", error, claim=claim, owner=unwind
    )
    if outcome.status != "ok":
        logger.warning("run %s: revoke of undo %d not recorded: %s", run_id, step, outcome)
        return
    # The older compensations and the conclusion still have to run.
    remaining = list(getattr(request, "chain", None) or [])
    send_rest(core.app, remaining, getattr(request, "id", None), getattr(request, "root_id", None))
