"""What ``Saga.start_run`` accepts, checked before anything is written.

A run id ends up in places with rules of their own: Redis keys ``saga:{run_id}:...`` whose
``{...}`` is the Redis Cluster hash tag (a brace in the id moves the keys to different slots),
Celery task ids and idempotency keys ``<run>:<step>`` (a colon makes them ambiguous), and a SQL
column of fixed width (a longer id would never be recorded, so the run would never conclude).
A bad value is refused at the door, naming what is wrong, rather than surfacing in the reaper.
"""

from __future__ import annotations

import math
import re

from saga.errors import InvalidRunIdError, InvalidRunOptionError

#: The records' ``run_id`` columns are sized for it (``saga.records``).
RUN_ID_MAX_LENGTH = 128
_RUN_ID_CHARACTER = re.compile(r"[A-Za-z0-9._-]")
_RUN_ID_START = re.compile(r"[A-Za-z0-9]")


def check_run_id(run_id: object) -> str:
    """``run_id`` if it is 1-128 characters of ``[A-Za-z0-9._-]`` starting with a letter or
    digit; ``InvalidRunIdError`` saying what is wrong otherwise."""
    if not isinstance(run_id, str):
        raise InvalidRunIdError(f"a run id must be a string, got {type(run_id).__name__}")
    if not run_id:
        raise InvalidRunIdError("a run id must not be empty (pass None for a generated one)")
    shown = repr(run_id if len(run_id) <= 40 else run_id[:40] + "...")
    if len(run_id) > RUN_ID_MAX_LENGTH:
        raise InvalidRunIdError(
            f"run id {shown} is {len(run_id)} characters long: at most {RUN_ID_MAX_LENGTH}"
        )
    for position, character in enumerate(run_id):
        if not _RUN_ID_CHARACTER.fullmatch(character):
            raise InvalidRunIdError(
                f"run id {shown} has {character!r} at position {position}: only letters, digits, "
                "'.', '_' and '-' are accepted ('{' and '}' would break the Redis Cluster hash "
                "tag, ':' the <run>:<step> task ids)"
            )
    if not _RUN_ID_START.fullmatch(run_id[0]):
        raise InvalidRunIdError(f"run id {shown} must start with a letter or a digit")
    return run_id


def check_deadline(deadline: object) -> float:
    """Seconds a run may go without progress: a positive, finite number (not a bool, which
    Python would count as 1 second)."""
    if isinstance(deadline, bool) or not isinstance(deadline, int | float):
        raise InvalidRunOptionError(
            f"deadline must be a number of seconds, got {deadline!r} ({type(deadline).__name__})"
        )
    try:
        seconds = float(deadline)
    except OverflowError:
        seconds = math.inf
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidRunOptionError(
            f"deadline must be a positive, finite number of seconds, got {deadline!r}"
        )
    return seconds


def check_flag(name: str, value: object) -> bool:
    """A switch must be a real bool: ``"no"`` would otherwise turn it on."""
    if not isinstance(value, bool):
        raise InvalidRunOptionError(
            f"{name} must be True or False, got {value!r} ({type(value).__name__})"
        )
    return value
