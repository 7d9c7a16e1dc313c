"""What ``start_run`` accepts: run ids that fit the Redis hash tag, the task ids and the SQL
column, and deadlines the reaper can compute with. Refused values never reach Redis.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from redis.crc import key_slot

from saga import Saga, Settings, ToolRegistry
from saga.constants import run_keys, settled_key, step_idempotency_key
from saga.errors import InvalidRunIdError, InvalidRunOptionError, RunExistsError
from saga.validation import RUN_ID_MAX_LENGTH, check_deadline, check_flag, check_run_id

GOOD_IDS = [
    "a",
    "7",
    "abc",
    "tenant-acme.session_42",
    "0f4c2b6e9a1d4e3f8b7c6d5e4f3a2b1c",
    "A" * RUN_ID_MAX_LENGTH,
]


# -- run ids -----------------------------------------------------------------------------------


@pytest.mark.parametrize("run_id", GOOD_IDS)
def test_good_run_ids_are_accepted_unchanged(run_id: str) -> None:
    """Letters, digits, '.', '_' and '-', up to 128 characters, starting alphanumeric."""
    assert check_run_id(run_id) == run_id


@pytest.mark.parametrize("run_id", GOOD_IDS)
def test_every_accepted_run_id_keeps_all_its_keys_in_one_cluster_slot(run_id: str) -> None:
    """R11: the hash tag of an accepted id is the whole id, so every key of the run (and every
    settled list) lands in the same Redis Cluster slot."""
    keys = [*run_keys(run_id), settled_key(run_id, 1), settled_key(run_id, 99)]

    assert {key_slot(key.encode()) for key in keys} == {key_slot(run_id.encode())}


@pytest.mark.parametrize(
    ("run_id", "problem"),
    [
        ("}abc", "has '}' at position 0"),  # R11: the keys spread over six slots
        ("a}b", "has '}' at position 1"),
        ("{}x", "has '{' at position 0"),
        ("run:7", "has ':' at position 3"),  # task id "run:7:1" reads as run "run", step 7
        ("with space", "has ' ' at position 4"),
        ("café", "has 'é' at position 3"),  # not ASCII: \w would have let it in
        ("line\n", "has '\\n' at position 4"),  # a regex with $ would have let it in
        ("-leading-dash", "must start with a letter or a digit"),
        (".hidden", "must start with a letter or a digit"),
        ("", "must not be empty"),
        ("x" * (RUN_ID_MAX_LENGTH + 1), f"is {RUN_ID_MAX_LENGTH + 1} characters long"),
        ("tenant-acme-" + "x" * 66, None),  # R4's 78 characters: fine now, the column grew
    ],
)
def test_bad_run_ids_are_refused_saying_why(run_id: str, problem: str | None) -> None:
    """Braces, colons, other characters, a bad first character, empty or too long: refused,
    and the message says which character or limit."""
    if problem is None:
        assert check_run_id(run_id) == run_id
        return
    with pytest.raises(InvalidRunIdError) as refused:
        check_run_id(run_id)

    assert problem in str(refused.value)


@pytest.mark.parametrize("run_id", [42, b"abc", None, ["abc"]])
def test_a_run_id_that_is_not_a_string_is_refused(run_id: Any) -> None:
    """Not even an int: ids are compared as strings everywhere."""
    with pytest.raises(InvalidRunIdError, match="must be a string"):
        check_run_id(run_id)


def test_an_accepted_run_id_keeps_task_ids_unambiguous() -> None:
    """With no ':' in the id, the last ':' of ``<run>:<step>`` always splits it right."""
    run_id = check_run_id("tenant.a-b_c")

    assert step_idempotency_key(run_id, 12).rsplit(":", 1) == [run_id, "12"]
    assert step_idempotency_key(run_id, 12).split(":") == [run_id, "12"]


# -- deadline and flag -------------------------------------------------------------------------


@pytest.mark.parametrize(("deadline", "seconds"), [(1, 1.0), (0.5, 0.5), (900, 900.0)])
def test_positive_deadlines_are_accepted_as_seconds(deadline: float, seconds: float) -> None:
    """An int or a float above zero."""
    assert check_deadline(deadline) == seconds


@pytest.mark.parametrize(
    "deadline",
    ["soon", "60", True, False, None, 0, -5, float("nan"), float("inf"), 10**400, [60]],
    ids=repr,
)
def test_bad_deadlines_are_refused(deadline: Any) -> None:
    """R15: a string (which used to crash the reaper), a bool, zero, negative, NaN, infinite."""
    with pytest.raises(InvalidRunOptionError, match="deadline must be a"):
        check_deadline(deadline)


@pytest.mark.parametrize("value", ["no", 1, None])
def test_the_after_pivot_switch_must_be_a_bool(value: Any) -> None:
    """``"no"`` is truthy: only True or False turn the switch."""
    with pytest.raises(InvalidRunOptionError, match="allow_reversible_after_pivot"):
        check_flag("allow_reversible_after_pivot", value)
    assert check_flag("allow_reversible_after_pivot", False) is False


# -- start_run ---------------------------------------------------------------------------------


class CreateSpy:
    """Stands in for ``RunStore.create``: records what would have been written."""

    def __init__(self, exists: bool = False) -> None:
        self.calls: list[tuple[str, float, bool]] = []
        self.exists = exists

    def __call__(self, run_id: str, deadline: float, allow_after_pivot: bool = False) -> bool:
        self.calls.append((run_id, deadline, allow_after_pivot))
        return not self.exists


@pytest.fixture
def saga() -> Iterator[Saga]:
    """A Saga whose Redis is never reached: ``store.create`` is a spy."""
    settings = Settings(redis_url="redis://127.0.0.1:1/0", run_deadline_seconds=900)
    made = Saga(Celery("validation", set_as_current=False), ToolRegistry(), settings)
    made.store.create = CreateSpy()  # type: ignore[method-assign]
    yield made
    made.store.client.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"run_id": "a}b"},
        {"run_id": "x" * 200},
        {"run_id": ""},
        {"deadline": "soon"},
        {"deadline": 0},
        {"allow_reversible_after_pivot": "no"},
    ],
    ids=repr,
)
def test_start_run_refuses_bad_arguments_before_writing_anything(
    saga: Saga, kwargs: dict[str, Any]
) -> None:
    """Defects 7, 14, 15: a bad id, deadline or switch is refused and Redis is never asked."""
    with pytest.raises((InvalidRunIdError, InvalidRunOptionError)):
        saga.start_run(**kwargs)

    assert saga.store.create.calls == []  # type: ignore[attr-defined]


def test_start_run_passes_good_arguments_through(saga: Saga) -> None:
    """A good id and deadline are written as given; no id or deadline means the defaults."""
    run = saga.start_run("tenant-acme.42", deadline=30, allow_reversible_after_pivot=True)
    generated = saga.start_run()

    calls = saga.store.create.calls  # type: ignore[attr-defined]
    assert calls[0] == ("tenant-acme.42", 30.0, True)
    assert run.run_id == "tenant-acme.42"
    assert calls[1] == (generated.run_id, 900, False)
    assert check_run_id(generated.run_id) == generated.run_id


def test_start_run_with_an_id_in_use_raises_run_exists(saga: Saga) -> None:
    """The one refusal that needs Redis has a class of its own."""
    saga.store.create = CreateSpy(exists=True)  # type: ignore[method-assign]

    with pytest.raises(RunExistsError, match="run taken already exists"):
        saga.start_run("taken")
