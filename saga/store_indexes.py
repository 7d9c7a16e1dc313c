"""The indexes that find runs nobody names: which runs the reaper must look at and when, which
runs exist in creation order (the listing), which wait for a person, and the reaper's pulse.

Scripts touch one run's keys only (one hash tag, so Redis Cluster can run them), so the
indexes, which span every run, are written beside the scripts, never inside them; a run's
creation is here because its order (indexes first, then the script) is what keeps them
complete. The asyncio client (``saga.aio``) creates runs with the same ``queue_create``.

Each index is sharded over ``IndexLayout.shards`` sorted sets (``saga.constants``), a run's
entries in one shard of each: on a Redis Cluster the shards sit on different masters, so no
single key takes every run's writes. A reader that spans runs (the reaper's pass, a listing's
page) reads every shard and merges. The layout is fixed per store (``INDEX_LAYOUT_KEY``): a
process configured with another shard count refuses to use it (``check_layout``) rather than
write entries where no one reads them; ``saga indexes reshard`` moves them.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from typing import Any, cast

from saga.constants import (
    ACTIVE_RUNS_KEY,
    AWAITING_APPROVAL_KEY,
    CREATED_RUNS_KEY,
    INDEX_LAYOUT_KEY,
    REAPER_PASS_KEY,
    IndexLayout,
)
from saga.errors import ConfigurationError
from saga.store_scripts import StoreCore, queue_script, reachable

#: Seconds between two checks of the store's index layout by a running process (a reshard
#: under a running process makes it refuse, instead of writing to shards no one reads).
_LAYOUT_RECHECK = 60.0


class RunIndexes(StoreCore):
    """The store's cross-run indexes, and a run's creation, which enters it into them."""

    _layout_checked = float("-inf")

    def check_layout(self, force: bool = False) -> None:
        """``ConfigurationError`` when the store's indexes are sharded otherwise than this
        process is configured to shard them; a store whose indexes were never sharded takes
        this process's layout if its unsharded indexes are empty. Checked once a minute at
        most (``force``: now), before the indexes are written or read."""
        if not force and time.monotonic() - self._layout_checked < _LAYOUT_RECHECK:
            return
        with reachable("index_layout"):
            recorded = self.client.get(INDEX_LAYOUT_KEY)
            if recorded is None and self.layout.shards > 1:
                legacy = [k for k in UNSHARDED_INDEXES if self.client.exists(k)]
                if legacy:
                    raise ConfigurationError(layout_mismatch(1, self.layout.shards))
                self.client.set(INDEX_LAYOUT_KEY, str(self.layout.shards), nx=True)
                recorded = self.client.get(INDEX_LAYOUT_KEY)
        found = int(recorded) if recorded is not None else 1
        if found != self.layout.shards:
            raise ConfigurationError(layout_mismatch(found, self.layout.shards))
        self._layout_checked = time.monotonic()

    def recorded_layout(self) -> IndexLayout:
        """The layout the store's indexes are in (``INDEX_LAYOUT_KEY``; absent: one shard)."""
        with reachable("index_layout"):
            recorded = self.client.get(INDEX_LAYOUT_KEY)
        return IndexLayout(int(recorded) if recorded is not None else 1)

    def index_sizes(self) -> dict[str, list[int]]:
        """How many entries each shard of each index holds (``saga indexes``), in the
        recorded layout."""
        layout = self.recorded_layout()
        kinds = ("active", "created", "awaiting")
        with reachable("index_sizes"), self.client.pipeline(transaction=False) as pipe:
            for kind in kinds:
                for key in layout.every(kind):
                    pipe.zcard(key)
            counts = [int(n) for n in pipe.execute()]
        return {
            kind: counts[i * layout.shards : (i + 1) * layout.shards]
            for i, kind in enumerate(kinds)
        }

    def reshard(self, to: IndexLayout) -> dict[str, int]:
        """Move every index entry from the recorded layout to ``to``, then record ``to``: how
        many entries of each index were moved. For a deployment whose workers and callers are
        all stopped (one still running would write where no one reads); safe to run again
        after an interruption: entries are copied before the old keys go, and the layout is
        recorded last."""
        source = self.recorded_layout()
        moved = {"active": 0, "created": 0, "awaiting": 0}
        if source != to:
            for kind in moved:
                destination = {"active": to.active_of, "created": to.created_of}.get(
                    kind, to.awaiting_of
                )
                for key in source.every(kind):
                    moved[kind] += self._copy_index(key, destination)
            with reachable("reshard"):
                for kind in moved:
                    for key in set(source.every(kind)) - set(to.every(kind)):
                        self.client.delete(key)
                if to.shards == 1:
                    self.client.delete(INDEX_LAYOUT_KEY)
                else:
                    self.client.set(INDEX_LAYOUT_KEY, str(to.shards))
        self.layout = to
        self._layout_checked = float("-inf")
        return moved

    def _copy_index(self, key: str, destination: Any) -> int:
        """Copy the sorted set ``key`` entry by entry to ``destination(run_id)``'s key."""
        copied = 0
        with reachable("reshard"):
            batch: list[tuple[str, float]] = []
            for member, score in self.client.zscan_iter(key, count=500):
                batch.append((str(member), float(score)))
                if len(batch) == 500:
                    copied += self._add_entries(batch, destination)
                    batch = []
            copied += self._add_entries(batch, destination)
        return copied

    def _add_entries(self, entries: list[tuple[str, float]], destination: Any) -> int:
        if entries:
            with self.client.pipeline(transaction=False) as pipe:
                for run_id, score in entries:
                    pipe.zadd(destination(run_id), {run_id: score})
                pipe.execute()
        return len(entries)

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
        hash tag: Redis Cluster). On a cluster the index shard and the run live on different
        masters, where one pipeline keeps no order: two round trips, the indexes first."""
        self.check_layout()
        created = f"{self.now():.6f}"
        args = (int(allow_after_pivot), deadline, agent, input_json, created, int(deadline_open))
        sha = self._scripts["create"].sha
        if self.clustered:
            with reachable("create"), self.client.pipeline(transaction=False) as pipe:
                queue_indexes(pipe, self.layout, run_id, args)
                pipe.execute()
            # The run's own master confirms the script's writes, not these.
            self.confirm_keys("create", self.layout.entries_of(run_id))
            made = self._pipelined(
                "create", run_id, lambda pipe: queue_script(pipe, sha, run_id, args),
                transaction=False,
            )[-1]  # fmt: skip
        else:
            *_, made = self._pipelined(
                "create",
                run_id,
                lambda pipe: queue_create(pipe, sha, run_id, args, self.layout),
                transaction=False,
            )
        return str(made) == "1"

    def schedule(self, run_id: str, at: float) -> None:
        """Have the reaper look at the run at ``at`` (Redis clock)."""
        self.check_layout()
        with reachable("schedule"):
            self.client.zadd(self.layout.active_of(run_id), {run_id: at})

    def schedule_sooner(self, run_id: str, at: float) -> None:
        """Bring the reaper's look at the run forward to ``at``, never put it off (a look that
        comes early is harmless: the reaper reads the run and schedules the next). Read, then
        written (``ZADD LT`` needs Redis 6.2)."""
        self.check_layout()
        key = self.layout.active_of(run_id)
        with reachable("schedule"):
            current = self.client.zscore(key, run_id)
            if current is None or at < float(current):
                self.client.zadd(key, {run_id: at})

    def due_at(self, run_id: str) -> float | None:
        """When the reaper is to look at the run (Redis clock), None if it is not indexed."""
        self.check_layout()
        with reachable("due_at"):
            score = self.client.zscore(self.layout.active_of(run_id), run_id)
        return None if score is None else float(score)

    def due_runs(self, now: float, limit: int = 1000) -> list[tuple[str, float]]:
        """Runs the reaper should look at by ``now``, with when they were due, earliest first
        across the shards."""
        self.check_layout()
        keys = self.layout.every("active")
        with reachable("due_runs"), self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.zrangebyscore(key, "-inf", now, start=0, num=limit, withscores=True)
            shards = pipe.execute()
        merged = heapq.merge(
            *(((float(score), str(run)) for run, score in cast(list[Any], due)) for due in shards)
        )
        return [(run_id, score) for score, run_id in merged][:limit]

    def active_runs(self) -> list[str]:
        """Every run the reaper keeps an eye on (running, unwinding, or kept for retention)."""
        self.check_layout()
        with reachable("active_runs"):
            return [run for key in self.layout.every("active") for run in self._members(key)]

    def active_count(self) -> int:
        """How many runs the reaper keeps an eye on, over every shard."""
        self.check_layout()
        with reachable("active_runs"), self.client.pipeline(transaction=False) as pipe:
            for key in self.layout.every("active"):
                pipe.zcard(key)
            return sum(int(n) for n in pipe.execute())

    def newest(self, top: str, bottom: str, batch: int) -> list[tuple[str, float]]:
        """Up to ``batch`` runs of the listing's index scored from ``top`` down to ``bottom``
        (``ZREVRANGEBYSCORE`` bounds), newest first across the shards: fewer only when every
        shard has no more."""
        self.check_layout()
        with reachable("list_runs"), self.client.pipeline(transaction=False) as pipe:
            for key in self.layout.every("created"):
                pipe.zrevrangebyscore(key, top, bottom, start=0, num=batch, withscores=True)
            return merge_newest(pipe.execute(), batch)

    def _members(self, key: str) -> list[str]:
        return cast(list[str], self.client.zrange(key, 0, -1))

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
        """Drop a run whose keys are gone from the reaper's index and the listing's (one
        transaction where the run's shard is one slot's or the store one server)."""
        self.check_layout()
        layout = self.layout
        together = not self.clustered or layout.shards > 1
        with reachable("forget"), self.client.pipeline(transaction=together) as pipe:
            pipe.zrem(layout.active_of(run_id), run_id)
            pipe.zrem(layout.created_of(run_id), run_id)
            pipe.zrem(layout.awaiting_of(run_id), run_id)
            pipe.execute()

    def request_indexed(self, run_id: str, at: float) -> None:
        """The run asked a person about a call (at ``at``; the first ask's time is kept)."""
        self.check_layout()
        with reachable("request_approval"):
            self.client.zadd(self.layout.awaiting_of(run_id), {run_id: at}, nx=True)

    def awaiting_approval(self) -> list[str]:
        """The runs that asked a person about a call and may still be waiting, oldest first
        across the shards."""
        self.check_layout()
        with reachable("awaiting_approval"), self.client.pipeline(transaction=False) as pipe:
            for key in self.layout.every("awaiting"):
                pipe.zrange(key, 0, -1, withscores=True)
            shards = pipe.execute()
        merged = heapq.merge(
            *(((float(score), str(run)) for run, score in cast(list[Any], s)) for s in shards)
        )
        return [run_id for _, run_id in merged]

    def done_awaiting(self, run_id: str) -> None:
        """The run no longer runs, so no call of it awaits a person any more."""
        self.check_layout()
        with reachable("done_awaiting"):
            self.client.zrem(self.layout.awaiting_of(run_id), run_id)


#: The keys of an unsharded store's indexes: a store that has them is not resharded silently.
UNSHARDED_INDEXES = (ACTIVE_RUNS_KEY, CREATED_RUNS_KEY, AWAITING_APPROVAL_KEY)


def merge_newest(shards: Sequence[Any], batch: int) -> list[tuple[str, float]]:
    """The first ``batch`` of each shard's newest-first entries (``ZREVRANGEBYSCORE ...
    WITHSCORES``), merged newest first, ties by run id descending as Redis orders one set."""
    merged = heapq.merge(
        *(((float(s), str(r)) for r, s in cast(list[Any], shard)) for shard in shards),
        reverse=True,
    )
    return [(run_id, score) for score, run_id in merged][:batch]


def layout_mismatch(found: int, configured: int) -> str:
    """What a process configured with ``configured`` shards says of a store sharded ``found``
    ways."""
    return (
        f"the saga store's run indexes are sharded {found} way(s), and this process is "
        f"configured for {configured} (SAGA_INDEX_SHARDS): set SAGA_INDEX_SHARDS={found}, or "
        f"stop every worker and caller and run `saga indexes reshard --shards {configured}` "
        "to move the entries"
    )


def queue_indexes(pipe: Any, layout: IndexLayout, run_id: str, args: Sequence[Any]) -> None:
    """Queue a new run's index entries on ``pipe``: the reaper's (due at the creation time
    plus the deadline) and the listing's (the creation time, only if new to it)."""
    created, deadline = float(args[4]), float(args[1])
    pipe.zadd(layout.active_of(run_id), {run_id: created + deadline})
    pipe.zadd(layout.created_of(run_id), {run_id: created}, nx=True)


def queue_create(
    pipe: Any, sha: str, run_id: str, args: Sequence[Any], layout: IndexLayout | None = None
) -> None:
    """Queue a run's creation (``RunStore.create`` says why in this order) on ``pipe``: the
    indexes, then ``create.lua`` (``sha``) with ``args``, whose 5th is the creation time."""
    queue_indexes(pipe, layout or IndexLayout(), run_id, args)
    queue_script(pipe, sha, run_id, args)
