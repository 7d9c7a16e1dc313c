"""Listing runs newest first across Redis and SQL (``saga.listing``): the created-time index,
the cursor, and ``Client.list_runs`` on top of it. Real Redis (a database of its own) and a
real SQLite records file; the runs are made with the store's own ``create`` script.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from saga import Settings
from saga.client import Client
from saga.errors import InvalidCursorError
from saga.listing import RunFilter, list_runs, page_of_runs
from saga.records import RecordStore, RunRecord
from saga.redis_urls import redis_client
from saga.stack import RunStore
from tests.conftest import TEST_DB, redis_url_with_db

#: A Redis database of these tests' own (flushed before and after).
LISTING_DB = int(os.environ.get("SAGA_TEST_LISTING_REDIS_DB", str(TEST_DB + 2)))


@pytest.fixture
def listing_url(redis_url: str) -> Iterator[str]:
    url = redis_url_with_db(redis_url, LISTING_DB)
    redis_client(url).flushdb()
    yield url
    redis_client(url).flushdb()


@pytest.fixture
def store(listing_url: str) -> Iterator[RunStore]:
    made = RunStore.from_url(listing_url, 3600)
    yield made
    made.client.close()


@pytest.fixture
def records(tmp_path: Path) -> Iterator[RecordStore]:
    made = RecordStore(f"sqlite:///{tmp_path / 'records.db'}")
    yield made
    made.dispose()


def recorded(records: RecordStore, run_id: str, created: float, state: str = "completed") -> None:
    """A run as its SQL record holds it once its keys expired."""
    with Session(records.engine) as session, session.begin():
        session.add(
            RunRecord(
                run_id=run_id,
                state=state,
                reason="",
                created_at=datetime.fromtimestamp(created, UTC),
                ended_at=datetime.fromtimestamp(created + 1, UTC),
                steps=[],
                agent="refund",
            )
        )


def test_the_newest_run_is_listed_past_ten_thousand_older_ones(listing_url: str) -> None:
    """Regression (review 2, R05): the listing read the reaper's due-time index, 10,000
    entries at most, so past that the newest runs were left out of a newest-first listing."""
    # Given 10,000 hosted runs, then one more
    # (no message is sent: the broker is the session's, or follows the store's URL)
    client = Client(redis_url=listing_url, settings=Settings())
    try:
        for i in range(10_000):
            client.store.create(f"old-{i:05d}", 900, agent="slow", input_json="x")
        client.store.create("the-newest-run", 900, agent="slow", input_json="x")
        # When the five newest are listed
        listed = [r.run_id for r in client.list_runs(limit=5)]
        # Then the newest is first, then the others by age
        assert listed == ["the-newest-run", "old-09999", "old-09998", "old-09997", "old-09996"]
        assert [r.run_id for r in client.list_runs(agent="nobody", limit=5)] == []
    finally:
        client.store.client.close()


def test_pages_across_redis_and_sql_lose_nothing_while_runs_are_created(
    store: RunStore, records: RecordStore
) -> None:
    """Pages of 3 over runs live in Redis and runs only in SQL, one in both (Redis's state
    wins), with new runs created between pages: every run older than the first page is seen
    once, in order, and the new ones are not slipped in."""
    # Given four live runs, five recorded ones older and newer than them, one in both
    now = store.now()
    for i in range(5):
        recorded(records, f"sql-{i}", now - 100 + i * 40)  # before, among, after the live ones
    for i in range(4):
        store.create(f"live-{i}", 900)
    both = store.client.hget("saga:{live-1}:run", "created")
    assert both is not None
    recorded(records, "live-1", float(both), state="escalated")
    expected = sorted(
        {f"sql-{i}" for i in range(5)} | {f"live-{i}" for i in range(4)},
        key=lambda run_id: _created(store, records, run_id),
        reverse=True,
    )
    # When paging by 3, creating a run before each next page
    seen, cursor = [], None
    while True:
        page = page_of_runs(store, records, RunFilter(limit=3), cursor)
        assert len(page.rows) <= 3
        seen += page.rows
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
        store.create(f"new-{len(seen)}", 900)
    # Then each run once, newest first, the one in both as Redis has it
    assert [r.run_id for r in seen] == expected
    assert {r.run_id: r.state for r in seen}["live-1"] == "running"
    assert {r.run_id: r.source for r in seen}["live-1"] == "redis"


def test_filters_apply_to_both_sources(store: RunStore, records: RecordStore) -> None:
    """State, agent and creation bounds select from Redis and SQL alike; a bad cursor is an
    error naming it, not an empty page."""
    now = store.now()
    recorded(records, "old-done", now - 50)
    store.create("live-refund", 900, agent="refund", input_json="x")
    store.create("live-other", 900, agent="other", input_json="x")
    assert [r.run_id for r in list_runs(store, records, RunFilter(agent="refund"))] == [
        "live-refund",
        "old-done",
    ]
    assert [r.run_id for r in list_runs(store, records, RunFilter(states=("completed",)))] == [
        "old-done"
    ]
    assert [r.run_id for r in list_runs(store, records, RunFilter(until=now - 1))] == ["old-done"]
    assert [r.run_id for r in list_runs(store, records, RunFilter(escalated=True))] == []
    with pytest.raises(InvalidCursorError):
        page_of_runs(store, records, RunFilter(), "not-a-cursor")


def test_a_forgotten_run_leaves_the_created_index(store: RunStore) -> None:
    """The reaper's ``forget`` (keys gone) drops the run from both indexes."""
    store.create("gone", 900)
    created = store.layout.created_of("gone")
    assert store.client.zscore(created, "gone") is not None
    store.forget("gone")
    assert store.client.zscore(created, "gone") is None
    assert store.due_at("gone") is None


def _created(store: RunStore, records: RecordStore, run_id: str) -> float:
    live = store.client.hget(f"saga:{{{run_id}}}:run", "created")
    if live:
        return float(live)
    row = records.run(run_id)
    assert row is not None
    return row.created_at.replace(tzinfo=UTC).timestamp()


def test_a_selective_filter_pages_through_many_batches(store: RunStore) -> None:
    """One run in ten matches: pages of 2 read the index a growing batch at a time and find
    every match, newest first, once."""
    for i in range(60):
        store.create(f"run-{i:02d}", 900, agent="rare" if i % 10 == 3 else "common", input_json="x")
    seen, cursor = [], None
    while True:
        page = page_of_runs(store, None, RunFilter(agent="rare", limit=2), cursor)
        seen += [r.run_id for r in page.rows]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert seen == [f"run-{i:02d}" for i in (53, 43, 33, 23, 13, 3)]
