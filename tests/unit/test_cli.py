"""The ``saga`` command's parts that need no service: parsing, exit codes, finding the app,
and how requeue and resolve call the Saga of the installed version."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import click
import pytest
from click.testing import CliRunner

from saga.cli import ExitCode, cli
from saga.cli.context import (
    Env,
    Failure,
    corrections_from,
    load_saga,
    mask,
    parse_assignment,
    parse_since,
)
from saga.cli.escalations import accepts
from saga.errors import NothingToRequeueError


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("3.status=open", (3, "status", "open")),
        ("3.amount_cents=1200", (3, "amount_cents", 1200)),
        ('3.status="open"', (3, "status", "open")),
        ("2.flag=true", (2, "flag", True)),
        ('2.meta={"a": [1, 2]}', (2, "meta", {"a": [1, 2]})),
        ("2.note=", (2, "note", "")),
        ("2.note=a=b", (2, "note", "a=b")),
        ("2.id=null", (2, "id", None)),
    ],
)
def test_set_values_are_json_when_they_parse_else_text(text: str, parsed: tuple[Any]) -> None:
    assert parse_assignment(text) == parsed


@pytest.mark.parametrize("text", ["status=open", "x.status=open", "3.=open", "3.status", "3.a.b=1"])
def test_a_malformed_set_is_a_usage_error(text: str) -> None:
    with pytest.raises(click.BadParameter, match=r"STEP\.ARG=VALUE"):
        parse_assignment(text)


def test_corrections_group_by_step() -> None:
    assert corrections_from(["3.status=open", "3.note=x", "2.credit_id=cr_1"]) == {
        3: {"status": "open", "note": "x"},
        2: {"credit_id": "cr_1"},
    }


def test_since_takes_durations_and_dates() -> None:
    now = time.time()
    assert abs((parse_since(None, None, "2h") or 0) - (now - 7200)) < 5
    assert abs((parse_since(None, None, "1.5d") or 0) - (now - 129_600)) < 5
    assert parse_since(None, None, "2024-01-02") == 1_704_153_600.0  # UTC unless said
    assert parse_since(None, None, "2024-01-02T01:00:00+01:00") == 1_704_153_600.0
    assert parse_since(None, None, None) is None
    with pytest.raises(click.BadParameter):
        parse_since(None, None, "last week")


def test_help_documents_the_exit_codes() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for code in ("0 ok", "1 the thing asked for is in a bad state", "2 bad usage", "3 not found"):
        assert code in text
    assert "4 a service (Redis, broker, database) unreachable" in text
    assert [int(c) for c in ExitCode] == [0, 1, 2, 3, 4]


def test_urls_are_printed_without_their_password() -> None:
    assert mask("redis://user:s3cret@host:6379/0") == "redis://user:***@host:6379/0"
    assert mask("postgresql+psycopg://app:pw@db/saga") == "postgresql+psycopg://app:***@db/saga"
    assert mask("redis://host:6379/0") == "redis://host:6379/0"


def test_an_app_that_cannot_be_loaded_is_a_usage_error() -> None:
    for spec, message in [
        ("no_such_module_here:saga", "cannot import the app"),
        ("json:dumps", "is a function, not a saga.Saga"),
        ("json:nothing", "json has no nothing"),
        (":saga", "expected module:attr"),
    ]:
        with pytest.raises(Failure, match=message) as failed:
            load_saga(spec)
        assert failed.value.exit_code == ExitCode.USAGE
    with pytest.raises(Failure, match="no app: name its Saga with --app"):
        load_saga("no_such_module_here:saga", explicit=False)


def test_keyword_support_is_read_off_the_signature() -> None:
    def old(run_id: str) -> int:
        return 0

    def new(run_id: str, *, corrections: Mapping[int, Any] | None = None, by: str = "") -> int:
        return 0

    def wrapped(run_id: str, **options: Any) -> int:
        return 0

    assert not accepts(old, "corrections") and not accepts(old, "by")
    assert accepts(new, "corrections") and accepts(new, "by")
    assert accepts(wrapped, "corrections")


# -- requeue and resolve against this version's Saga, or the next one's --------------------------


class OldSaga:
    """Today's signature: no corrections, no by."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def requeue_failed_compensations(self, run_id: str) -> int:
        self.calls.append((run_id, {}))
        return 1


class NewSaga(OldSaga):
    """The signature the records work adds: corrections and who asked."""

    def requeue_failed_compensations(  # type: ignore[override]
        self,
        run_id: str,
        *,
        corrections: Mapping[int, Mapping[str, Any]] | None = None,
        by: str = "",
    ) -> int:
        self.calls.append((run_id, {"corrections": corrections, "by": by}))
        return 2


def _invoke(monkeypatch: pytest.MonkeyPatch, saga: Any, *args: str) -> Any:
    monkeypatch.setattr(Env, "saga", lambda self: saga)
    return CliRunner().invoke(cli, list(args))


def test_set_is_refused_where_requeue_takes_no_corrections(monkeypatch: pytest.MonkeyPatch) -> None:
    saga = OldSaga()
    result = _invoke(monkeypatch, saga, "requeue", "run-1", "--set", "3.status=open")
    assert result.exit_code == ExitCode.USAGE
    assert "not supported by this version" in result.output
    assert saga.calls == []
    plain = _invoke(monkeypatch, saga, "requeue", "run-1", "--no-wait", "--by", "ada")
    assert plain.exit_code == 0, plain.output
    assert saga.calls == [("run-1", {})]  # no by either: this signature has none


def test_set_and_by_are_passed_where_requeue_takes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    saga = NewSaga()
    result = _invoke(
        monkeypatch,
        saga,
        "requeue",
        "run-1",
        "--set",
        "3.status=closed",
        "--set",
        "2.cents=5",
        "--by",
        "ada",
        "--no-wait",
        "--json",
    )
    assert result.exit_code == 0, result.output
    corrections = {3: {"status": "closed"}, 2: {"cents": 5}}
    assert saga.calls == [("run-1", {"corrections": corrections, "by": "ada"})]
    assert '"requeued": 2' in result.output


def test_nothing_to_requeue_is_a_bad_state(monkeypatch: pytest.MonkeyPatch) -> None:
    class Nothing(OldSaga):
        def requeue_failed_compensations(self, run_id: str) -> int:
            raise NothingToRequeueError(f"run {run_id} is compensated and has nothing")

    result = _invoke(monkeypatch, Nothing(), "requeue", "run-1", "--no-wait")
    assert result.exit_code == ExitCode.BAD_STATE
    assert "has nothing" in result.output


def test_a_bad_run_id_or_set_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    saga = NewSaga()
    assert _invoke(monkeypatch, saga, "requeue", "a run").exit_code == ExitCode.USAGE
    assert _invoke(monkeypatch, saga, "requeue", "r", "--set", "oops").exit_code == ExitCode.USAGE
    assert saga.calls == []
