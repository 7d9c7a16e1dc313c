"""The shop's "external systems" (stock, payments, mail), kept in Redis so the worker's
effects are visible to the tests. Like real ones, each answers a repeated idempotency key with
the effect it already applied, and counts how often an effect really happened.
"""

from __future__ import annotations

import functools
import os

import redis

APPLIED = "shop:applied"


@functools.cache
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True)


def _db() -> redis.Redis:
    return _client(os.environ.get("SAGA_REDIS_URL", "redis://localhost:6379/0"))


def _apply(kind: str, key: str, value: str) -> str:
    """Record an effect once per idempotency key; return its id."""
    effect_id = f"{kind}-{key}"
    if _db().hsetnx(f"shop:{kind}", effect_id, value):
        _db().hincrby(APPLIED, effect_id, 1)
    return effect_id


def reserve(sku: str, quantity: int, key: str) -> str:
    return _apply("reservation", key, f"{sku}x{quantity}")


def release(reservation_id: str) -> None:
    _db().sadd("shop:released", reservation_id)


def charge(order_id: str, amount_cents: int, key: str) -> str:
    return _apply("charge", key, f"{order_id}:{amount_cents}")


def find_charge(key: str) -> str | None:
    """The charge made under ``key``, if the payment system has one."""
    charge_id = f"charge-{key}"
    return charge_id if _db().hexists("shop:charge", charge_id) else None


def find_reservation(key: str) -> str | None:
    """The reservation made under ``key``, if the stock system has one."""
    reservation_id = f"reservation-{key}"
    return reservation_id if _db().hexists("shop:reservation", reservation_id) else None


def refund(charge_id: str) -> None:
    _db().sadd("shop:refunded", charge_id)


def send_receipt(order_id: str, email: str, key: str) -> str:
    return _apply("receipt", key, f"{order_id}:{email}")


def find_receipt(key: str) -> str | None:
    """The receipt sent under ``key``, if the mail system sent one."""
    receipt_id = f"receipt-{key}"
    return receipt_id if _db().hexists("shop:receipt", receipt_id) else None


# -- what the drill asks (``verify``: how many times the effect under a key is live) -----------


def reservation_live(key: str) -> int:
    reservation_id = f"reservation-{key}"
    held = _db().hexists("shop:reservation", reservation_id)
    return int(held and not released(reservation_id))


def charge_live(key: str) -> int:
    charge_id = f"charge-{key}"
    return int(_db().hexists("shop:charge", charge_id) and not refunded(charge_id))


def receipt_sent(key: str) -> int:
    return int(_db().hexists("shop:receipt", f"receipt-{key}"))


# -- what the tests look at --------------------------------------------------------------------


def effects(kind: str, run_id: str) -> dict[str, int]:
    """The ``kind`` effects of one run, with how many times each was really applied."""
    ids = [i for i in _db().hkeys(f"shop:{kind}") if i.startswith(f"{kind}-{run_id}:")]
    return {i: int(_db().hget(APPLIED, i) or 0) for i in ids}


def released(reservation_id: str) -> bool:
    return bool(_db().sismember("shop:released", reservation_id))


def refunded(charge_id: str) -> bool:
    return bool(_db().sismember("shop:refunded", charge_id))
