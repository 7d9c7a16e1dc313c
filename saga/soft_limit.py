"""Celery's soft time limit belongs to the call saga makes for the task (a tool's, or a hosted
turn's model call), never to saga's bookkeeping.

In a prefork pool the soft limit is a signal (``SIGUSR1``) that billiard's handler turns into
``SoftTimeLimitExceeded``, raised wherever the task's code happens to be. In the tool's call
that is what it is for: the tool overran, the delivery records a retry (or a failure) and
lets go. Raised in what saga does around the call (recording the outcome, pushing the undo,
asking Celery for the retry), it cut that short: the message was acknowledged as failed with
the outcome unrecorded or the retry unsent, and the run waited for the reaper's deadline.

A hosted turn played in a prefork pool had it worse: arriving while the model's answer was
recorded or the turn's calls dispatched, it was taken for a bug in the policy and the run was
unwound, its answer thrown away.

So a pool process's signal is taken by a handler of saga's own, installed over billiard's on
the process's first tool task or turn. Outside such a delivery it raises as billiard's does.
Within one, inside ``call_time`` (the tool's call, its lookup; the model's call) it raises
too; arriving before the call, it is raised as the call begins (the delivery spent the call's
time: it retries); arriving after, it is noted and saga finishes recording, which the hard
time limit still bounds (the lease outlasts it by ``LEASE_MARGIN_SECONDS``). A turn takes a
model call cut short as a model that did not answer: asked again under ``model_retry``. In
the solo or threads pool, which have no soft limit by signal, nothing changes. (billiard's,
not Celery's: the signal, its handler and the exception are the pool's, which Celery
re-exports.)
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
    in_call = False
    #: Arrived outside the call's time and not raised (Celery sends it once a delivery).
    pending = False
    #: The process whose handler is saga's (a pool process forked later installs its own).
    installed_in = 0


_delivery = _Delivery()


def _taken_here() -> bool:
    """Whether saga's handler takes the soft limit in this process: in a billiard pool
    process's main thread, installed over billiard's handler on the first delivery and kept
    (outside a tool's or a turn's delivery it raises as billiard's does)."""
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
    if not _delivery.active or _delivery.in_call:
        raise SoftTimeLimitExceeded()  # as billiard's handler does
    _delivery.pending = True  # (no logging here: a handler may interrupt the logging itself)


@contextmanager
def kept_for_the_call(what: str) -> Iterator[None]:
    """For one delivery of a tool task or a hosted turn (``what`` names it in the log): the
    soft limit raises only in ``call_time``. A no-op outside a billiard pool process's main
    thread."""
    if _delivery.active or not _taken_here():
        yield
        return
    _delivery.active, _delivery.in_call, _delivery.pending = True, False, False
    try:
        yield
    finally:
        deferred = _delivery.pending
        _delivery.active = _delivery.in_call = _delivery.pending = False
        if deferred:
            logger.warning(
                "%s: the soft time limit came while saga recorded the delivery, outside the "
                "call: recorded in full (the hard time limit still bounds it)",
                what,
            )


@contextmanager
def call_time() -> Iterator[None]:
    """The call's own time (a tool's call or lookup, a hosted turn's model call): the soft
    limit raises here, as Celery's does, and one that came before the call is raised as it
    begins."""
    if not _delivery.active or _delivery.in_call:
        yield
        return
    _delivery.in_call = True
    try:
        if _delivery.pending:  # the call's time was spent before it began
            _delivery.pending = False
            raise SoftTimeLimitExceeded()
        yield
    finally:
        _delivery.in_call = False
