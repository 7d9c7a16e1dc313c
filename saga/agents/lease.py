"""The asking lease of a hosted turn, kept alive while its model call runs.

One delivery of a turn asks the model at a time: it takes the turn's lease (``ask_model.lua``,
``SET NX PX`` with a token of its own) and releases it when it records the answer. Turns run
on a threads pool, where Celery enforces no time limit, and a reasoning model may think for
minutes: a lease of fixed length would run out under a call still in progress, and a second
delivery (a repeated ``enqueue_run``, a revival, a redelivery) would ask the model again.

So the lease is short and renewed: a keeper thread per process extends every lease its model
calls hold, a third of the lease at a time, and only while the token is still the holder's.
When the asker dies, the renewals stop with it and the lease runs out within one lease length,
after which another delivery may ask.

The case left is the store away for longer than a lease while the call runs (a failover whose
election outlasts it): the keeper cannot renew, and the lease runs out on the new master. So a
keeper whose renewal failed tries again every ``_RETRY_AWAY`` seconds, not a third of a lease
later, and a renewal that finds the lease gone, nobody else holding it and the turn unanswered
takes it back (``turn_lease.lua``). A lease's clock cannot tell an asker that died from one
the store could not hear, so the turn remembers its asker until it records an answer or gives
the call up, and a delivery that finds that asker's lease run out fences it (``ASKER_FENCE``,
``ask_model.lua``): it asks only once it has seen the store answer for a while, without a gap,
and no renewal from the asker in that time. A live asker's keeper renews within
``_RETRY_AWAY`` of the store's return, well inside the fence, and the fencing delivery waits
for its answer; a dead asker's turn is asked again a fence later than its lease ran out.
"""

from __future__ import annotations

import logging
import threading
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from saga.errors import SagaError
from saga.stack import RunStore
from saga.turn_scripts import AskerFence

logger = logging.getLogger("saga.agents")

#: How long a turn's asking lease lasts without renewal: how soon another delivery may ask
#: once the asker died. Renewed every third of it while the call runs.
TURN_LEASE_SECONDS = 60.0
#: How soon a keeper tries again after a renewal the store did not answer.
_RETRY_AWAY = 0.5
#: A delivery that finds the last asker's lease run out under it asks only after the store
#: answered it for 4 s, never 1.5 s without, and the asker did not renew meanwhile: eight
#: times the keeper's retry, and longer than a replay's longest pause (2 s) for an asker
#: that holds an answer to record.
ASKER_FENCE = AskerFence(seconds=4.0, gap_seconds=1.5)
#: How often a fencing delivery asks again (well inside the fence's gap).
FENCE_POLL = 0.5


@dataclass
class Hold:
    """One model call's lease: its turn, its token, and whether a renewal found it gone."""

    run_id: str
    turn: int
    seconds: float
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    lost: bool = False


class LeaseKeeper:
    """Renews the asking leases this process holds, from one daemon thread."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self._by_id: dict[int, Hold] = {}
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        #: How long the keeper sleeps between passes (a third of the shortest lease it holds).
        self._interval = float("inf")

    @contextmanager
    def holding(self, hold: Hold) -> Iterator[Hold]:
        """Keep ``hold`` renewed for the duration of the block (the model call). The keeper
        is woken only when it must pass sooner than it planned: a turn worker with a hundred
        model calls in flight pays a dict insert per call, not a thread wake-up."""
        with self._changed:
            self._by_id[id(hold)] = hold
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="saga-turn-leases", daemon=True
                )
                self._thread.start()
            elif hold.seconds / 3 < self._interval:
                self._changed.notify_all()
        try:
            yield hold
        finally:
            with self._changed:
                self._by_id.pop(id(hold), None)

    def renew_all(self) -> bool:
        """One pass: extend every lease still held by its token; mark the others lost. False
        when the store did not answer a renewal (the keeper then tries again soon)."""
        with self._changed:
            holds = list(self._by_id.values())
        answered = True
        for hold in holds:
            try:
                kept = self.store.renew_turn_lease(hold.run_id, hold.turn, hold.token, hold.seconds)
            except SagaError as exc:  # Redis away: try again soon, while the lease lasts
                logger.warning(
                    "run %s turn %d: lease not renewed (%s)", hold.run_id, hold.turn, exc
                )
                answered = False
                continue
            if kept == "retaken":
                logger.warning(
                    "run %s turn %d: the asking lease ran out while the store was away; "
                    "taken back under the model call still running",
                    hold.run_id,
                    hold.turn,
                )
            elif kept != "ok" and not hold.lost:
                hold.lost = True
                logger.error(
                    "run %s turn %d: the asking lease ran out under a model call still running",
                    hold.run_id,
                    hold.turn,
                )
        return answered

    def _run(self) -> None:
        answered = True
        while True:
            with self._changed:
                while not self._by_id:
                    self._interval = float("inf")
                    if not self._changed.wait(timeout=60.0) and not self._by_id:
                        self._thread = None
                        return
                self._interval = min(h.seconds for h in self._by_id.values()) / 3
                if not answered:
                    self._interval = min(self._interval, _RETRY_AWAY)
                self._changed.wait(timeout=self._interval)
            answered = self.renew_all()


_keepers: weakref.WeakKeyDictionary[RunStore, LeaseKeeper] = weakref.WeakKeyDictionary()
_keepers_lock = threading.Lock()


def keeper_for(store: RunStore) -> LeaseKeeper:
    """The one keeper of ``store``'s leases in this process."""
    with _keepers_lock:
        keeper = _keepers.get(store)
        if keeper is None:
            keeper = _keepers[store] = LeaseKeeper(store)
        return keeper
