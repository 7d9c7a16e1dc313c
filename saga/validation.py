"""What saga accepts from an application or a person, checked before anything is written.

A run id ends up in places with rules of their own: Redis keys ``saga:{run_id}:...`` whose
``{...}`` is the Redis Cluster hash tag (a brace in the id moves the keys to different slots),
Celery task ids and idempotency keys ``<run>:<step>`` (a colon makes them ambiguous), and a SQL
column of fixed width (a longer id would never be recorded, so the run would never conclude).
A bad value is refused at the door, naming what is wrong, rather than surfacing in the reaper.
The same goes for free text (who did it, a note, a reason, an agent's name): a value its SQL
column cannot hold would make the run's record fail on every attempt, so it never enters.
"""

from __future__ import annotations

import math
import re

from saga.errors import (
    InvalidEscalationIdError,
    InvalidRunIdError,
    InvalidRunOptionError,
    InvalidTextError,
)

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


#: The suffix of the reaper's own escalation of a run it could not read or resolve
#: (``<run>:reaper``): it concludes no unwind, so it names no generation.
REAPER_ESCALATION = "reaper"
#: A generation: the run's requeue count, digits only (``str.isdigit`` would take "²").
_GENERATION = re.compile(r"[0-9]{1,18}")


def parse_escalation_id(escalation_id: object) -> tuple[str, int | None]:
    """``(run_id, generation)`` of ``<run_id>:<generation>``, or ``(run_id, None)`` for the
    reaper's ``<run_id>:reaper``: the one reading of an escalation id, for every surface, so
    an id one of them lists is an id the others open. ``InvalidEscalationIdError`` otherwise."""
    if not isinstance(escalation_id, str):
        raise InvalidEscalationIdError(
            f"an escalation id must be a string, got {type(escalation_id).__name__}"
        )
    run_id, colon, suffix = escalation_id.rpartition(":")
    shown = repr(escalation_id if len(escalation_id) <= 60 else escalation_id[:60] + "...")
    if not colon or not (suffix == REAPER_ESCALATION or _GENERATION.fullmatch(suffix)):
        raise InvalidEscalationIdError(
            f"escalation id {shown} is not <run_id>:<generation> (digits) or "
            f"<run_id>:{REAPER_ESCALATION}"
        )
    try:
        check_run_id(run_id)
    except InvalidRunIdError as exc:
        raise InvalidEscalationIdError(f"escalation id {shown}: {exc}") from None
    return run_id, None if suffix == REAPER_ESCALATION else int(suffix)


def generation_of(escalation_id: str) -> int | None:
    """The generation an escalation id names; None for the reaper's (or an unreadable) id."""
    try:
        return parse_escalation_id(escalation_id)[1]
    except InvalidEscalationIdError:
        return None


def check_escalation_id(escalation_id: object) -> str:
    """``escalation_id`` if ``parse_escalation_id`` reads it."""
    parse_escalation_id(escalation_id)
    return str(escalation_id)


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


#: The records' name columns (``resolved_by``, ``actions.by``, ``runs.agent``) hold this many.
NAME_MAX_LENGTH = 200
#: Notes and reasons a person or an app writes: unbounded columns, bounded here all the same.
TEXT_MAX_LENGTH = 10_000
#: A reason given for an abort or a denial (its ``(by <name>)`` suffix included).
REASON_MAX_LENGTH = 2000
#: An agent's name: what ``saga.agent(...)`` accepts, and what a web app may enqueue.
AGENT_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")


def check_text(field: str, value: object, *, max_length: int = TEXT_MAX_LENGTH) -> str:
    """Free text bound for Redis and the records (a note, a reason, a user's message): a
    string of at most ``max_length`` characters that every database can store: no NUL
    (PostgreSQL refuses it in text) and no lone surrogate (it is not UTF-8)."""
    if not isinstance(value, str):
        raise InvalidTextError(f"{field} must be a string, got {type(value).__name__}")
    if len(value) > max_length:
        raise InvalidTextError(
            f"{field} is {len(value)} characters long: at most {max_length} are accepted"
        )
    if "\x00" in value:
        raise InvalidTextError(f"{field} contains a NUL character (\\x00) at {value.index(chr(0))}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidTextError(
            f"{field} is not valid text: {exc.reason} at position {exc.start}"
        ) from None
    return value


def check_name(
    field: str, value: object, *, max_length: int = NAME_MAX_LENGTH, required: bool = True
) -> str:
    """Who did something (``by``): text of one line, at most ``max_length`` characters (the
    records' column); not blank when ``required``."""
    name = check_text(field, value, max_length=max_length)
    if required and not name.strip():
        raise InvalidTextError(f"{field} must not be empty: say who")
    control = next((c for c in name if ord(c) < 32 or ord(c) == 127), None)
    if control is not None:
        raise InvalidTextError(f"{field} contains the control character {control!r}")
    return name


def check_agent_name(name: object) -> str:
    """An agent's name as declared (``saga.agent``): what a web app may enqueue."""
    if not isinstance(name, str) or not AGENT_NAME.fullmatch(name):
        shown = repr(name if not isinstance(name, str) or len(name) <= 40 else name[:40] + "...")
        raise InvalidTextError(
            f"agent name {shown} is not one an agent can have: 1-64 characters of lowercase "
            "letters, digits, '_' and '-', starting with a letter"
        )
    return name
