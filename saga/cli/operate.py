"""``saga requeue``, ``saga resolve`` and ``saga reap``: the commands that change a run.

Requeue and reap need the application's ``Saga`` (its tools run the undos and the lookups);
resolve only writes the records, unless this version's ``Saga`` resolves escalations itself.
"""

from __future__ import annotations

import getpass
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import click

from saga.cli.context import (
    Env,
    ExitCode,
    Failure,
    bad_state,
    corrections_from,
    emit_json,
    not_found,
    parse_escalation_id,
)
from saga.cli.escalations import accepts
from saga.errors import (
    DispatchError,
    InvalidCorrectionError,
    MessageNotSentError,
    OperationRefusedError,
    UnknownEscalationError,
)
from saga.validation import check_run_id

# Types only: a command imports these on use (``saga --help`` loads none of them).
if TYPE_CHECKING:
    from saga.stack import RunHead, RunStore


def _os_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name in some containers
        return "unknown"


by_option = click.option(
    "--by",
    default=_os_user,
    show_default="the OS user",
    help="Who does it (kept with the run's records).",
)


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option(
    "--set",
    "assignments",
    multiple=True,
    metavar="STEP.ARG=VALUE",
    help="Correct an undo's argument first (repeatable): STEP is the step the undo belongs "
    "to, VALUE is JSON if it parses as JSON, else text. E.g. --set 3.status=open",
)
@by_option
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait for the outcome.")
@click.option("--timeout", type=click.FloatRange(0), default=120.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.pass_obj
def requeue(
    env: Env,
    run_id: str,
    assignments: tuple[str, ...],
    by: str,
    wait: bool,
    timeout: float,
    as_json: bool,
) -> None:
    """Run an escalated run's failed compensations again, once the cause is fixed, each with a
    fresh retry budget; then wait for the outcome (exit 1 if it escalates again)."""
    check_run_id(run_id)
    corrections = corrections_from(list(assignments))
    saga = env.saga()
    method = saga.requeue_failed_compensations
    options: dict[str, Any] = {}
    if corrections:
        if not accepts(method, "corrections"):
            raise Failure(
                "--set is not supported by this version of saga (its requeue takes no "
                "corrections): requeue without it, or fix the undo's target by hand",
                ExitCode.USAGE,
            )
        options["corrections"] = corrections
    if accepts(method, "by"):
        options["by"] = by
    try:
        count = method(run_id, **options)
    except InvalidCorrectionError as exc:  # nothing ran: the input was wrong
        raise Failure(str(exc), ExitCode.USAGE) from exc
    except OperationRefusedError as exc:  # nothing to requeue, resolved by hand, ...
        bad_state(str(exc))
    except (DispatchError, MessageNotSentError) as exc:  # requeued; the same again sends it
        raise Failure(str(exc), ExitCode.UNREACHABLE) from exc
    result: dict[str, object] = {"run_id": run_id, "requeued": count, "by": by}
    if not wait:
        result["state"] = "unwinding"
        _say(env, as_json, result, f"run {run_id}: {count} undo(s) requeued by {by}")
        return
    head = _wait(env.store, run_id, timeout)
    picture = env.store.picture(run_id)
    escalation = f"{run_id}:{picture.generation}" if picture is not None else ""
    result["state"] = head.state.value
    if head.state.value == "escalated":
        result["escalation_id"] = escalation
        _say(env, as_json, result, "")
        bad_state(
            f"run {run_id} escalated again ({picture.reason if picture else ''}): "
            f"{env.command()} escalation show {escalation}"
        )
    _say(env, as_json, result, f"run {run_id}: {count} undo(s) requeued by {by}: {head.state}")


def _wait(store: RunStore, run_id: str, timeout: float) -> RunHead:
    """Until the run has ended and its records are written; exit 1 if that takes too long."""
    deadline = time.monotonic() + timeout
    while True:
        head = store.head(run_id)
        if head is None:
            not_found(f"run {run_id} is gone from Redis (its retention ran out meanwhile)")
        if head.state.ended and head.recorded:
            return head
        if time.monotonic() >= deadline:
            bad_state(
                f"run {run_id} is still {head.state.value} after {timeout:g}s"
                + (" (its record is not written yet)" if head.state.ended else "")
                + f": see `saga show {run_id}`"
            )
        time.sleep(0.25)


def _say(env: Env, as_json: bool, result: dict[str, object], text: str) -> None:
    if as_json:
        emit_json(result)
    elif text:
        env.console.print(text)


@click.command()
@click.argument("escalation_id", metavar="ID", callback=parse_escalation_id)
@click.option("--note", required=True, help="What was done about it (kept with the record).")
@by_option
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.pass_obj
def resolve(env: Env, escalation_id: str, note: str, by: str, as_json: bool) -> None:
    """Close an escalation dealt with by hand, saying what was done."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.cli.queries import find_escalation
    from saga.engine import Saga

    if not note.strip():
        raise Failure("--note must say what was done", ExitCode.USAGE)
    saga = env.saga() if hasattr(Saga, "resolve_escalation") else None
    record = find_escalation(env.records, escalation_id)
    if record is None:
        not_found(f"no escalation {escalation_id} (`saga escalations --all` lists them)")
    if record.resolved:
        bad_state(f"{escalation_id} is already resolved: {record.resolution}")
    if saga is not None:
        try:
            saga.resolve_escalation(escalation_id, note=note, by=by)
        except UnknownEscalationError as exc:
            not_found(str(exc))
        except OperationRefusedError as exc:  # closed meanwhile, a requeue unwinding, ...
            bad_state(str(exc))
    else:
        # This version records the resolution on every open escalation of the run (there is
        # one open at a time: a later escalation supersedes the earlier).
        env.records.resolve_escalations(record.run_id, resolution=f"resolved by {by}: {note}")
    after = find_escalation(env.records, escalation_id)
    resolution = after.resolution if after is not None else ""
    result = {"escalation_id": escalation_id, "resolved": True, "resolution": resolution}
    _say(env, as_json, result, f"{escalation_id}: {resolution}")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.pass_obj
def reap(env: Env, as_json: bool) -> None:
    """Run one pass of the reaper now (beat runs it every SAGA_REAP_INTERVAL seconds): exit 1
    if a run could not be handled (it is escalated)."""
    report = env.saga().reap()
    result = asdict(report)
    summary = ", ".join(f"{k}: {len(v) if isinstance(v, list) else v}" for k, v in result.items())
    _say(env, as_json, result, f"reaped: {summary}")
    if report.broken:
        bad_state("; ".join(f"run {run}: {problem}" for run, problem in report.broken))
