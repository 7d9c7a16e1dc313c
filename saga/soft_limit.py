"""Celery's soft time limit belongs to the tool's own time, never to saga's bookkeeping.

In a prefork pool the soft limit is a signal (``SIGUSR1``) that billiard's handler turns into
``SoftTimeLimitExceeded``, raised wherever the task's code happens to be. In the tool's call
that is what it is for: the tool overran, the delivery records a retry (or a failure) and
lets go. Raised in what saga does around the call (recording the outcome, pushing the undo,
asking Celery for the retry), it cut that short: the message was acknowledged as failed with
the outcome unrecorded or the retry unsent, and the run waited for the reaper's deadline.

So a pool process's signal is taken by a handler of saga's own, installed over billiard's on
the process's first tool task. Outside a tool task's delivery it raises as billiard's does.
Within one, inside ``tool_time`` (the tool's call, its lookup) it raises too; arriving before
the call, it is raised as the call begins (the delivery spent the tool's time: it retries);
arriving after, it is noted and saga finishes recording, which the hard time limit still
bounds (the lease outlasts it by ``LEASE_MARGIN_SECONDS``). In the solo or threads pool,
which have no soft limit by signal, nothing changes. (billiard's, not Celery's: the signal,
its handler and the exception are the pool's, which Celery re-exports.)
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from billiard.exceptions import SoftTimeLimitExceeded  # type: ignore[import-untyped]

logger = logging.getLogger("saga.worker")

_SIGNAL = getattr(signal, "SIGUSR1", None)


class _Delivery:
    """Where the one delivery a pool process runs at a time stands (its main thread's)."""

    active = False
    in_tool = False
    #: Arrived outside the tool's time and not raised (Celery sends it once a delivery).
    pending = False
    #: The process whose handler is saga's (a pool process forked later installs its own).
    installed_in = 0


_delivery = _Delivery()


def _taken_here() -> bool:
    """Whether saga's handler takes the soft limit in this process: in a billiard pool
    process's main thread, installed over billiard's handler on the first delivery and kept
    (outside a tool's delivery it raises as billiard's does)."""
    if _delivery.installed_in == os.getpid():
        return True
    if _SIGNAL is None or threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(_SIGNAL)
    try:
        from billiard.pool import soft_timeout_sighandler  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - billiard always ships it with Celery
        return False
    if current is not soft_timeout_sighandler:
        return False
    signal.signal(_SIGNAL, _on_soft_limit)
    _delivery.installed_in = os.getpid()
    return True


def _on_soft_limit(signum: int, frame: FrameType | None) -> None:
    if not _delivery.active or _delivery.in_tool:
        raise SoftTimeLimitExceeded()  # as billiard's handler does
    _delivery.pending = True  # (no logging here: a handler may interrupt the logging itself)


@contextmanager
def kept_for_the_tool(what: str) -> Iterator[None]:
    """For one tool task's delivery (``what`` names it in the log): the soft limit raises
    only in ``tool_time``. A no-op outside a billiard pool process's main thread."""
    if _delivery.active or not _taken_here():
        yield
        return
    _delivery.active, _delivery.in_tool, _delivery.pending = True, False, False
    try:
        yield
    finally:
        deferred = _delivery.pending
        _delivery.active = _delivery.in_tool = _delivery.pending = False
        if deferred:
            logger.warning(
                "%s: the soft time limit came while saga recorded the delivery, outside the "
                "tool's call: recorded in full (the hard time limit still bounds it)",
                what,
            )


@contextmanager
def tool_time() -> Iterator[None]:
    """The tool's own time (its call, its lookup): the soft limit raises here, as Celery's
    does, and one that came before the call is raised as it begins."""
    if not _delivery.active or _delivery.in_tool:
        yield
        return
    _delivery.in_tool = True
    try:
        if _delivery.pending:  # the tool's time was spent before its call
            _delivery.pending = False
            raise SoftTimeLimitExceeded()
        yield
    finally:
        _delivery.in_tool = False
