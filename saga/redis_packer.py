"""Packing a command into Redis's protocol in one C call.

redis-py (8.2 on) packs a command by encoding each argument in Python, even with hiredis
installed (which it then asks only to join them): an ``EVALSHA`` of a run's seven keys and its
arguments costs the caller about 20 µs, a fifth of the whole call's CPU, for every script a
step, an undo or the caller runs. ``hiredis.pack_command`` makes the same bytes in about 3 µs.

It makes the same bytes only for plain arguments, so this packer takes the C path for those
and hands anything else to redis-py's own packer, which keeps its behaviour (and its errors):
- ``str``, ``bytes``, ``int`` and ``float`` exactly: a subclass may encode otherwise (redis-py
  writes an ``IntEnum`` as its ``repr``), a ``bool`` is refused (``DataError``), and a
  ``memoryview`` is sent without a copy;
- a command name without a space (redis-py splits ``"SCRIPT LOAD"`` into two words);
- the connection's encoding UTF-8, strict (what hiredis encodes a ``str`` with).
``tests/unit/test_redis_packer.py`` compares the two packers' bytes.

redis-py before 8.2 packs with hiredis in one C call itself, and its hiredis packer takes no
fallback: there this module leaves redis-py's packer in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis._parsers.encoders import Encoder
from redis.connection import HiredisRespSerializer, PythonRespSerializer
from redis.utils import HIREDIS_AVAILABLE

__all__ = ["HiredisPacker", "pack_with_hiredis"]

_pack: Callable[[tuple[Any, ...]], bytes] | None = None
if HIREDIS_AVAILABLE:
    from hiredis import pack_command as _pack

_PLAIN = frozenset({str, bytes, int, float})

#: redis-py's own threshold for sending a large value as a buffer of its own.
_BUFFER_CUTOFF = 6000


class HiredisPacker:
    """A connection's ``command_packer``: plain commands packed by hiredis, others by the
    packer redis-py would have used (``fallback``)."""

    def __init__(self, fallback: Callable[..., list[bytes]]) -> None:
        self._fallback = fallback

    def pack(self, *args: Any) -> list[bytes]:
        name = args[0]
        if (type(name) is str and " " in name) or (type(name) is bytes and b" " in name):
            return self._fallback(*args)
        for arg in args:
            if type(arg) not in _PLAIN:
                return self._fallback(*args)
        return [_pack(args)]  # type: ignore[misc]


def pack_with_hiredis(connection_kwargs: dict[str, Any]) -> None:
    """Make the connections a pool opens with ``connection_kwargs`` pack with hiredis, where
    their encoding is hiredis's (UTF-8, strict) and no packer was chosen already."""
    if _pack is None or connection_kwargs.get("command_packer") is not None:
        return
    encoding = str(connection_kwargs.get("encoding", "utf-8"))
    errors = str(connection_kwargs.get("encoding_errors", "strict"))
    if encoding.lower().replace("-", "").replace("_", "") != "utf8" or errors != "strict":
        return
    encoder = Encoder(encoding, errors, False)  # type: ignore[no-untyped-call]
    python = PythonRespSerializer(_BUFFER_CUTOFF, encoder.encode)  # redis-py's own pair
    try:
        own = HiredisRespSerializer(python.pack, encoder.encode)  # type: ignore[no-untyped-call]
    except TypeError:
        # redis-py before 8.2: its hiredis packer takes no arguments, and already packs a
        # command in one C call (it encodes nothing in Python first). It stays.
        return
    connection_kwargs["command_packer"] = HiredisPacker(own.pack)
