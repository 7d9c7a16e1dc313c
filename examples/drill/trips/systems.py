"""The trip's "external systems" (seats, payments), kept in Redis so the drill can read them.
Each records every effect with the idempotency key it was made under, as an audit log would,
and each says whether an effect is live now: what ``verify`` asks."""

from __future__ import annotations

import functools
import os

import redis


@functools.cache
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True)


def _db() -> redis.Redis:
    return _client(os.environ.get("SAGA_REDIS_URL", "redis://localhost:6379/0"))


# -- seats -------------------------------------------------------------------------------------


def hold_seat(flight: str, key: str) -> str:
    """Hold a seat once per idempotency key."""
    hold_id = f"hold-{key}"
    if _db().hsetnx("trips:holds", hold_id, flight):
        _db().decr(f"trips:free:{flight}")
    return hold_id


def release_seat(hold_id: str, key: str) -> None:
    """Give the seat back. Not idempotent: a repeat gives it back again (the bug)."""
    flight = _db().hget("trips:holds", hold_id)
    _db().incr(f"trips:free:{flight}")
    _db().sadd("trips:released", hold_id)
    _db().hincrby("trips:releases", key, 1)  # the audit log: which undo, how many times


def hold_live(key: str) -> int:
    hold_id = f"hold-{key}"
    held = _db().hexists("trips:holds", hold_id)
    return int(held and not _db().sismember("trips:released", hold_id))


def releases(key: str) -> int:
    return int(_db().hget("trips:releases", key) or 0)


# -- payments ----------------------------------------------------------------------------------


def charge(order_id: str, amount_cents: int, key: str) -> str:
    """Charge once per idempotency key; the order keeps its charges in order."""
    charge_id = f"charge-{key}"
    if _db().hsetnx("trips:charges", charge_id, f"{order_id}:{amount_cents}"):
        _db().rpush(f"trips:order:{order_id}", charge_id)
    return charge_id


def latest_charge(order_id: str) -> str | None:
    found = _db().lrange(f"trips:order:{order_id}", -1, -1)
    return found[0] if found else None


def refund(charge_id: str) -> None:
    _db().sadd("trips:refunded", charge_id)


def charge_live(key: str) -> int:
    charge_id = f"charge-{key}"
    made = _db().hexists("trips:charges", charge_id)
    return int(made and not _db().sismember("trips:refunded", charge_id))


def send_ticket(order_id: str, email: str, key: str) -> str:
    ticket_id = f"ticket-{key}"
    _db().hsetnx("trips:tickets", ticket_id, f"{order_id}:{email}")
    return ticket_id


def ticket_sent(key: str) -> int:
    return int(_db().hexists("trips:tickets", f"ticket-{key}"))
