"""``saga.redis_packer``: the bytes hiredis packs are redis-py's, byte for byte, and whatever
hiredis would pack otherwise goes to redis-py's own packer, with its errors; with a redis-py
that packs in one C call itself (before 8.2), redis-py's packer stays."""

from __future__ import annotations

import enum
import inspect
from typing import Any

import pytest
import redis
from redis.connection import Connection, HiredisRespSerializer
from redis.exceptions import DataError

from saga import redis_packer
from saga.redis_packer import HiredisPacker, pack_with_hiredis
from saga.redis_urls import redis_client

#: redis-py 8.2 on: its hiredis packer encodes in Python first and takes a fallback, and saga
#: packs with its own. Before: redis-py's packs in one C call, and saga leaves it.
SAGA_PACKS = "fallback" in inspect.signature(HiredisRespSerializer).parameters
saga_packs = pytest.mark.skipif(
    not SAGA_PACKS, reason="this redis-py packs with hiredis itself: saga's packer is not used"
)


class Shade(enum.IntEnum):
    DARK = 1


class Word(str):
    pass


KEYS = [f"saga:run:{{r-{i}}}:head" for i in range(7)]

#: Commands as the store, the reaper and kombu send them, and the edges of each type.
COMMANDS: list[tuple[Any, ...]] = [
    ("EVALSHA", "a" * 40, 7, *KEYS, "1733480000.123456", 12, "refund", ""),
    ("HGETALL", "saga:run:{r}:head"),
    ("SET", "k", "quotes \" ' \\ braces {} %s"),
    ("SET", "k", "é😀 non-ASCII and astral"),
    ("SET", "k", b"\x00\xff\r\n binary"),
    ("SET", "k", "x" * 100_000),  # past redis-py's buffer cutoff
    ("SET", "k", ""),
    ("ZADD", "idx", 0.1, "m", 1e20, "n", -0.0, "o", float("inf"), "p"),
    ("INCRBY", "k", -5),
    ("INCRBY", "k", 2**70),
    (b"LPUSH", b"queue", b"message"),
]

#: Arguments hiredis would pack otherwise than redis-py: redis-py's packer takes them.
ODD: list[tuple[Any, ...]] = [
    ("SET", "k", Shade.DARK),  # redis-py writes an IntEnum as its repr
    ("SET", "k", Word("plain")),
    ("SET", "k", bytearray(b"ba")),
    ("SET", "k", memoryview(b"mv")),
    ("SCRIPT LOAD", "return 1"),  # one word to redis-py's packer, two on the wire
    (b"CLIENT SETNAME", b"saga"),
]


def _packers() -> tuple[Connection, Connection]:
    fast: dict[str, Any] = {}
    pack_with_hiredis(fast)
    assert isinstance(fast["command_packer"], HiredisPacker)
    return Connection(**fast), Connection()


@saga_packs
@pytest.mark.parametrize("command", COMMANDS + ODD, ids=range(len(COMMANDS + ODD)))
def test_the_bytes_are_redis_pys(command: tuple[Any, ...]) -> None:
    fast, own = _packers()
    assert b"".join(fast.pack_command(*command)) == b"".join(own.pack_command(*command))


@saga_packs
@pytest.mark.parametrize("value", [True, None, object(), "\ud800"])
def test_what_redis_py_refuses_is_refused_alike(value: object) -> None:
    fast, own = _packers()
    with pytest.raises((DataError, UnicodeEncodeError)) as theirs:
        own.pack_command("SET", "k", value)
    with pytest.raises(theirs.type):
        fast.pack_command("SET", "k", value)


@saga_packs
def test_another_encoding_or_a_chosen_packer_is_left_alone() -> None:
    latin: dict[str, Any] = {"encoding": "latin-1"}
    lenient: dict[str, Any] = {"encoding_errors": "replace"}
    mine = object()
    chosen: dict[str, Any] = {"command_packer": mine}
    for kwargs in (latin, lenient, chosen):
        pack_with_hiredis(kwargs)
    assert "command_packer" not in latin and "command_packer" not in lenient
    assert chosen["command_packer"] is mine
    spelled: dict[str, Any] = {"encoding": "UTF8"}
    pack_with_hiredis(spelled)
    assert isinstance(spelled["command_packer"], HiredisPacker)


def test_the_stores_client_packs_with_hiredis_and_round_trips(redis_url: str) -> None:
    """A client from the store's URL: its connections use the packer, and what it writes is
    read back as written, through the C path and redis-py's alike."""
    client = redis_client(redis_url, decode_responses=True)
    blocking = redis_client(redis_url, blocking=True)
    try:
        for made in (client, blocking):
            packer = made.connection_pool.connection_kwargs.get("command_packer")
            assert isinstance(packer, HiredisPacker) if SAGA_PACKS else packer is None
        key = "saga-test:packer"
        for value in ("é😀 astral", "x" * 100_000, 2**70, 0.1):
            client.set(key, value)
            assert client.get(key) == str(value)
        client.delete(key)
    finally:
        client.close()
        blocking.close()


@saga_packs
def test_what_hiredis_would_pack_otherwise_is_written_as_redis_py_writes_it(
    redis_url: str,
) -> None:
    client = redis_client(redis_url, decode_responses=True)
    try:
        key = "saga-test:packer-odd"
        client.set(key, Shade.DARK)  # redis-py's packer: the repr, as before
        assert client.get(key) == repr(Shade.DARK)
        client.delete(key)
    finally:
        client.close()


def test_a_client_built_outside_saga_is_untouched(redis_url: str) -> None:
    plain = redis.Redis.from_url(redis_url)
    try:
        assert plain.connection_pool.connection_kwargs.get("command_packer") is None
    finally:
        plain.close()


def test_a_redis_py_whose_hiredis_packer_takes_no_fallback_keeps_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """redis-py before 8.2 (the image's lock held 8.1): its hiredis packer takes no arguments.
    Making a client must not fail there, and its connections keep redis-py's packer."""

    # Given redis-py's hiredis packer as it was before 8.2
    class Before82:
        def pack(self, *args: Any) -> list[bytes]:
            raise AssertionError("not used")

    monkeypatch.setattr(redis_packer, "HiredisRespSerializer", Before82)

    # When a pool's connection arguments are given saga's packer
    kwargs: dict[str, Any] = {}
    pack_with_hiredis(kwargs)

    # Then none was chosen: a connection made from them packs as redis-py's own does
    assert "command_packer" not in kwargs
    made, own = Connection(**kwargs), Connection()
    for command in COMMANDS:
        assert b"".join(made.pack_command(*command)) == b"".join(own.pack_command(*command))
