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
from saga.errors import InvalidTextError, NothingToRequeueError


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


@pytest.mark.parametrize(
    "text",
    ["status=open", "x.status=open", "3.=open", "3.status", "3.a.b=1", "².x=1", "٣.x=1", " .x=1"],
)
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
    assert "5 an optional dependency missing" in text
    assert [int(c) for c in ExitCode] == [0, 1, 2, 3, 4, 5]


def test_urls_are_printed_without_their_password() -> None:
    assert mask("redis://user:s3cret@host:6379/0") == "redis://user:***@host:6379/0"
    assert mask("postgresql+psycopg://app:pw@db/saga") == "postgresql+psycopg://app:***@db/saga"
    assert mask("redis://host:6379/0") == "redis://host:6379/0"
    assert mask("redis://saga:p/ss@w:rd@host/2") == "redis://saga:***@host/2"


def _refused() -> Exception:
    from sqlalchemy.exc import DataError

    return DataError("INSERT ...", {}, Exception("value too long for type character varying"))


@pytest.mark.parametrize(
    ("error", "code", "said"),
    [
        (_refused, ExitCode.BAD_STATE, "the records database refused it"),
        (
            lambda: InvalidTextError("by is 201 characters long: at most 200 are accepted"),
            ExitCode.USAGE,
            "by is 201 characters long",
        ),
    ],
)
def test_a_refused_statement_is_a_bad_state_and_unstorable_text_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, error: Any, code: ExitCode, said: str
) -> None:
    """No traceback: a statement the database refuses (a DataError) is exit 1, saying what it
    said; a name or note that cannot be stored is exit 2, naming the field."""

    class Refusing(NewSaga):
        def requeue_failed_compensations(self, run_id: str, **options: Any) -> int:
            raise error()

    result = _invoke(monkeypatch, Refusing(), "requeue", "run-1", "--no-wait")
    assert result.exit_code == code, result.output
    assert said in result.output and "Traceback" not in result.output


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


def test_no_app_is_guessed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --app or SAGA_APP, a command that needs the app says how to name it (exit 2),
    even where the demo's ``tasks.app`` is importable (as it is from the repository)."""
    monkeypatch.delenv("SAGA_APP", raising=False)
    result = CliRunner().invoke(cli, ["requeue", "run-1", "--no-wait"])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "needs the application's Saga: name it with --app module:attr" in result.output
    assert "tasks" not in result.output


def _spec_seen(monkeypatch: pytest.MonkeyPatch, args: list[str], env: str | None) -> str:
    seen: list[str] = []

    def load(spec: str) -> Any:
        seen.append(spec)
        return OldSaga()

    monkeypatch.setattr("saga.cli.context.load_saga", load)
    if env is None:
        monkeypatch.delenv("SAGA_APP", raising=False)
    else:
        monkeypatch.setenv("SAGA_APP", env)
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    return seen[0]


def test_the_app_is_taken_on_the_group_on_any_command_or_from_saga_app(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = ["requeue", "run-1", "--no-wait"]
    assert _spec_seen(monkeypatch, ["--app", "a.b:saga", *run], None) == "a.b:saga"
    assert _spec_seen(monkeypatch, [*run, "--app", "c.d:saga"], None) == "c.d:saga"
    assert _spec_seen(monkeypatch, run, "e.f:saga") == "e.f:saga"
    # the command's own --app wins over SAGA_APP
    assert _spec_seen(monkeypatch, [*run, "--app", "g.h:saga"], "e.f:saga") == "g.h:saga"


def test_every_command_takes_app() -> None:
    """Commands registered later (by anyone) get it too: add_command gives it."""

    def leaves(group: click.Group) -> list[click.Command]:
        found: list[click.Command] = []
        for command in group.commands.values():
            found += leaves(command) if isinstance(command, click.Group) else [command]
        return found

    extra = click.Command("extra", callback=lambda: None)
    cli.add_command(extra)
    try:
        for command in leaves(cli):
            assert any("--app" in p.opts for p in command.params), command.name
    finally:
        cli.commands.pop("extra")


@pytest.mark.parametrize(
    ("module", "extra"),
    [("psycopg", "postgres"), ("prometheus_client", "metrics"), ("flower", "flower")],
)
def test_a_missing_extra_is_named_with_its_own_exit_code(
    monkeypatch: pytest.MonkeyPatch, module: str, extra: str
) -> None:
    def missing(self: Env) -> Any:
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)

    monkeypatch.setattr(Env, "records", property(missing))
    result = CliRunner().invoke(cli, ["escalations"])
    assert result.exit_code == ExitCode.MISSING_EXTRA, result.output
    assert f"pip install 'saga-compensation[{extra}]'" in result.output
    assert "Traceback" not in result.output


def test_a_module_no_extra_brings_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(self: Env) -> Any:
        raise ModuleNotFoundError("No module named 'nothing_of_ours'", name="nothing_of_ours")

    monkeypatch.setattr(Env, "records", property(missing))
    result = CliRunner().invoke(cli, ["escalations"])
    assert isinstance(result.exception, ModuleNotFoundError)


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


# -- the listing's layout ------------------------------------------------------------------------


def _rows() -> list[Any]:
    from saga.cli.queries import RunRow

    tools = ("get_order", "issue_credit", "set_ticket_status", "send_reply", "notify_webhook")
    return [
        RunRow(
            run_id=f"{i:032x}",
            state=state,
            reason=reason,
            agent="refund" if i % 2 else "",
            created=1_764_000_000.0 + i,
            ended=None,
            tools=tools[: 2 + i % 4],
            source="database",
            escalation=f"{i:032x}:1" if state == "escalated" else "",
        )
        for i, (state, reason) in enumerate(
            [
                ("escalated", "compensation failed"),
                ("compensated", "step 4 failed"),
                ("escalated", "failed after an irreversible step"),
                ("completed", ""),
                ("escalated", "step 3 in doubt: no lookup declared for set_ticket_status"),
            ]
        )
    ]


@pytest.mark.parametrize("width", [120, 140, 200])
def test_runs_wrap_between_words_never_inside_one(width: int) -> None:
    import io

    from rich.console import Console

    from saga.cli.runs import runs_table

    rows = _rows()
    out = io.StringIO()
    Console(file=out, width=width, highlight=False).print(runs_table(rows))
    lines = out.getvalue().splitlines()
    # Every word of every cell is on one line, whole: ids, states, times, tools, reasons
    printed = {word.strip("│┃|, ") for line in lines for word in line.split()}
    for row in rows:
        assert row.run_id in printed and row.state in printed
        for tool in row.tools:
            assert tool in printed, (tool, width)
        for word in row.reason.replace(":", " ").split():
            assert any(word in p for p in printed), (word, width)
    assert all(len(line) <= width for line in lines)
