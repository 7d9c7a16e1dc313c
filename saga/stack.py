"""The compensation stack and run state, in Redis.

This is workflow state: it must outlive any worker, so it lives in Redis and every change that
touches more than one key is a single Lua script (``saga/lua``). Steps follow the durable-step
rule: check the recorded outcome before running, record the outcome after, so a redelivered
message replays instead of re-executing.

``RunStore`` is composed of one part per idea (as redis-py composes its client of command
mixins): the script calls and clock (``saga.store_scripts``), the reads (``saga.store_reads``),
the cross-run indexes (``saga.store_indexes``), the run's transitions
(``saga.store_transitions``) and the hosted loop's (``saga.turn_scripts``). This module is the
store's entry point: the composed class, and the names its callers import from here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from saga.constants import LOOK_AFTER_EXPIRY, IndexLayout
from saga.picture import CompensationRecord, RunPicture, RunView, StepRecord
from saga.redis_urls import redis_client
from saga.script_sources import script_sources as script_sources
from saga.settings import Settings
from saga.store_indexes import UNSHARDED_INDEXES as UNSHARDED_INDEXES
from saga.store_indexes import RunIndexes
from saga.store_indexes import layout_mismatch as layout_mismatch
from saga.store_indexes import merge_newest as merge_newest
from saga.store_indexes import queue_create as queue_create
from saga.store_indexes import queue_indexes as queue_indexes
from saga.store_reads import HEAD_FIELDS as HEAD_FIELDS
from saga.store_reads import RunHead, RunReads
from saga.store_reads import head_of as head_of
from saga.store_reads import picture_of as picture_of
from saga.store_reads import read_picture as read_picture
from saga.store_scripts import Outcome, ReplicaConfirmation
from saga.store_scripts import outcome_of as outcome_of
from saga.store_scripts import queue_script as queue_script
from saga.store_scripts import raise_first_error as raise_first_error
from saga.store_scripts import reachable as reachable
from saga.store_scripts import script_missing as script_missing
from saga.store_scripts import still_missing as still_missing
from saga.store_transitions import REVOKE_KILLED as REVOKE_KILLED
from saga.store_transitions import ChainPush, Conclusion, RunTransitions, StepPush
from saga.turn_scripts import TurnScripts

__all__ = [
    "CompensationRecord",
    "Outcome",
    "ReplicaConfirmation",
    "RunHead",
    "RunPicture",
    "RunStore",
    "RunView",
    "StepPush",
    "ChainPush",
    "Conclusion",
    "StepRecord",
]

#: Connections per process at most, and how long a call waits for a free one (then the store
#: is unavailable, as if Redis were away).
_MAX_CONNECTIONS = 512
_POOL_WAIT = 30.0


class RunStore(RunIndexes, RunReads, RunTransitions, TurnScripts):
    """Reads and changes one Redis's runs; safe to share between threads.

    Every time the scripts record comes from the Redis server's clock (``TIME``), so hosts with
    drifting clocks agree on leases and deadlines; ``now()`` reads the same clock.
    """

    @classmethod
    def from_url(
        cls,
        url: str,
        retention_seconds: int,
        *,
        confirmation: ReplicaConfirmation | None = None,
        layout: IndexLayout | None = None,
        **options: Any,
    ) -> RunStore:
        """A store on ``url`` whose connection pool waits for a free connection instead of
        raising (redis-py caps a plain pool at 100, and a web app with more threads waiting
        on results would see its calls fail). ``?max_connections=N`` in the URL sets the cap.
        A Sentinel URL (``saga.redis_urls``) gives a client of whichever server is master, a
        cluster URL one of the cluster. ``confirmation``: the replicas that must hold the
        writes that count; ``layout``: how the cross-run indexes are sharded (by default, one
        shard on one Redis or Sentinel, ``CLUSTER_INDEX_SHARDS`` on a cluster)."""
        options = {"max_connections": _MAX_CONNECTIONS, "timeout": _POOL_WAIT, **options}
        client = redis_client(url, blocking=True, decode_responses=True, **options)
        if layout is None:
            layout = Settings(redis_url=url).index_layout()
        return cls(client, retention_seconds, confirmation, layout)

    @classmethod
    def for_settings(cls, settings: Settings, url: str | None = None) -> RunStore:
        """The store ``settings`` describe (``url``: another URL of the same deployment)."""
        return cls.from_url(
            url or settings.redis_url,
            settings.retention_seconds,
            confirmation=ReplicaConfirmation(
                settings.replicas_to_confirm, settings.replica_confirm_timeout_ms
            ),
            layout=replace(settings, redis_url=url or settings.redis_url).index_layout(),
            **settings.redis_options,
        )

    def mark_recorded(self, run_id: str, version: str, notify: bool = True) -> bool:
        """The record of ``version`` is written: let the keys expire, (``notify``) wake
        whoever waits for the run's end, and have the reaper look at the run once the keys
        have expired, to drop it from its index.

        On one Redis the index entry is written by the same script: one round trip, and with
        ``appendfsync always`` one wait for the disk, at every run's end. On a cluster the
        run's index shard is in another slot than its keys, so the entry is written after."""
        self.check_layout()
        if not self.clustered:
            return self._mark_recorded(run_id, version, notify, self.layout.active_of(run_id))
        if not self._mark_recorded(run_id, version, notify, ""):
            return False
        self.schedule(run_id, self.now() + self.retention_seconds + LOOK_AFTER_EXPIRY)
        return True
