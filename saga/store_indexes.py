"""The indexes that find runs nobody names: which runs the reaper must look at and when, which
runs exist in creation order (the listing), which wait for a person, and the reaper's pulse.

Scripts touch one run's keys only (one hash tag, so Redis Cluster can run them), so the
indexes, which span every run, are written beside the scripts, never inside them; a run's
creation is here because its order (indexes first, then the script) is what keeps them
complete. The asyncio client (``saga.aio``) creates runs with the same ``queue_create``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from saga.constants import (
    ACTIVE_RUNS_KEY,
    AWAITING_APPROVAL_KEY,
    CREATED_RUNS_KEY,
    REAPER_PASS_KEY,
)
from saga.store_scripts import StoreCore, queue_script, reachable


class RunIndexes(StoreCore):
    """The store's cross-run indexes, and a run's creation, which enters it into them."""

    def create(
        self,
        run_id: str,
        deadline: float,
        allow_after_pivot: bool = False,
        agent: str = "",
        input_json: str = "",
        deadline_open: bool = False,
    ) -> bool:
        """Create the run (and, for a hosted ``agent``, its loop's hash with the input).
        ``deadline_open``: the deadline is a default the agent's own replaces
        (``adopt_deadline``).

        One round trip: the reaper's index (due at the deadline), the listing's index (by
        creation time, only if the run is new to it), then the script, which stamps the run
        with that same creation time, so a listing's cursor and the SQL record agree to the
        microsecond. Indexed first: a crash in between leaves index entries without keys,
        which the reaper and the listing skip and drop (never a run without them). The indexes
        are written here, not in the script, so every script touches one run's keys only (one
        hash tag: Redis Cluster)."""
        created = f"{self.now():.6f}"
        args = (int(allow_after_pivot), deadline, agent, input_json, created, int(deadline_open))
        sha = self._scripts["create"].sha
        *_, made = self._pipelined(
            "create", lambda pipe: queue_create(pipe, sha, run_id, args), transaction=False
        )
        return str(made) == "1"

    def schedule(self, run_id: str, at: float) -> None:
        """Have the reaper look at the run at ``at`` (Redis clock)."""
        with reachable("schedule"):
            self.client.zadd(ACTIVE_RUNS_KEY, {run_id: at})

    def due_runs(self, now: float, limit: int = 1000) -> list[tuple[str, float]]:
        """Runs the reaper should look at by ``now``, with when they were due."""
        with reachable("due_runs"):
            due = self.client.zrangebyscore(
                ACTIVE_RUNS_KEY, "-inf", now, start=0, num=limit, withscores=True
            )
        return [(str(run_id), float(score)) for run_id, score in cast(list[Any], due)]

    def active_runs(self) -> list[str]:
        """Every run the reaper keeps an eye on (running, unwinding, or kept for retention)."""
        with reachable("active_runs"):
            return cast(list[str], self.client.zrange(ACTIVE_RUNS_KEY, 0, -1))

    def note_reaper_pass(self) -> None:
        """The scheduled reaper finished a pass: what tells an operator beat is alive."""
        with reachable("note_reaper_pass"):
            self.client.set(REAPER_PASS_KEY, f"{self.now():.6f}")

    def last_reaper_pass(self) -> float | None:
        """When the scheduled reaper last finished a pass (Redis clock); None if never."""
        with reachable("last_reaper_pass"):
            value = self.client.get(REAPER_PASS_KEY)
        return float(value) if value else None

    def forget(self, run_id: str) -> None:
        """Drop a run whose keys are gone from the reaper's index and the listing's."""
        with reachable("forget"), self.client.pipeline(transaction=True) as pipe:
            pipe.zrem(ACTIVE_RUNS_KEY, run_id)
            pipe.zrem(CREATED_RUNS_KEY, run_id)
            pipe.zrem(AWAITING_APPROVAL_KEY, run_id)
            pipe.execute()

    def awaiting_approval(self) -> list[str]:
        """The runs that asked a person about a call and may still be waiting, oldest first."""
        with reachable("awaiting_approval"):
            return cast(list[str], self.client.zrange(AWAITING_APPROVAL_KEY, 0, -1))

    def done_awaiting(self, run_id: str) -> None:
        """The run no longer runs, so no call of it awaits a person any more."""
        with reachable("done_awaiting"):
            self.client.zrem(AWAITING_APPROVAL_KEY, run_id)


def queue_create(pipe: Any, sha: str, run_id: str, args: Sequence[Any]) -> None:
    """Queue a run's creation (``RunStore.create`` says why in this order) on ``pipe``: the
    indexes, then ``create.lua`` (``sha``) with ``args``, whose 5th is the creation time."""
    created, deadline = float(args[4]), float(args[1])
    pipe.zadd(ACTIVE_RUNS_KEY, {run_id: created + deadline})
    pipe.zadd(CREATED_RUNS_KEY, {run_id: created}, nx=True)
    queue_script(pipe, sha, run_id, args)
