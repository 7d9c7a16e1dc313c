"""``saga reversal RUN [STEP]``: the undos a person is asked about before they run, and the
answer: reverse it now, keep the effect (with a note, for the books), or decide later.

A tool declared with ``reversal="ask"`` (or a predicate that said so for this step) stops its
run's unwind at its undo until someone answers. Shown without an answer, the question: what
would be undone, with what, until when, and the hash an answer carries. The answer binds to
that very undo: if it changed since it was shown, the answer is refused.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from saga.cli.context import Env, bad_state, emit_json, not_found
from saga.cli.operate import by_option
from saga.validation import check_run_id

if TYPE_CHECKING:
    from saga.picture import RunPicture


@click.command()
@click.argument("run_id", metavar="RUN")
@click.argument("step", type=int, required=False)
@click.option("--reverse", "decision", flag_value="reverse", help="Reverse the effect now.")
@click.option("--keep", "decision", flag_value="keep", help="Keep the effect (needs --note).")
@click.option("--later", "decision", flag_value="later", help="Put the question off.")
@click.option("--note", default="", help="Why: kept with the decision in Redis and SQL.")
@click.option("--hash", "args_hash", default="", help="The hash shown with the question.")
@by_option
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.pass_obj
def reversal(
    env: Env,
    run_id: str,
    step: int | None,
    decision: str | None,
    note: str,
    args_hash: str,
    by: str,
    as_json: bool,
) -> None:
    """Show what a person is asked to decide about RUN's undos, or answer for STEP."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.errors import OperationRefusedError
    from saga.operations import waiting_for_a_person

    check_run_id(run_id)
    picture = env.store.picture(run_id)
    if picture is None:
        not_found(f"no run {run_id} in Redis")
    if decision is None:
        if as_json:
            emit_json({"run_id": run_id, "asked": waiting_for_a_person(picture)})
        else:
            _show_questions(env, picture)
        return
    if step is None:
        raise click.UsageError("name the STEP whose undo you decide about")
    if not args_hash:  # an answer binds to the undo its person was shown
        raise click.UsageError(
            f"pass --hash as `{env.command()} reversal {run_id}` shows it: the answer binds "
            "to the undo you looked at"
        )
    try:
        after = env.saga().decide_reversal(
            run_id, step, decision, args_hash=args_hash, by=by, note=note
        )
    except OperationRefusedError as exc:
        bad_state(str(exc))
    result = {"run_id": run_id, "step": step, "decision": decision, "by": by,
              "state": after.state.value}  # fmt: skip
    if as_json:
        emit_json(result)
        return
    env.console.print(f"run {run_id} step {step}: {decision} by {by}; the run is {after.state}")


def _show_questions(env: Env, picture: RunPicture) -> None:
    """Each question as the escalation card shows it: what would be undone and with what, why
    a person is asked, since and until when, earlier answers, and the commands that answer."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.escalations.questions import answer_commands, question_docs

    questions = question_docs(picture)
    if not questions:
        env.console.print(f"run {picture.run_id}: no undo waits for a person")
    for question in questions:
        commands = answer_commands(picture.run_id, question, env.command())
        args = json.dumps(question["args"], ensure_ascii=False, sort_keys=True)
        lines = [
            f"run {picture.run_id} step {question['step']}: {question['tool']} {args}",
            f"  undoes: {question['description'] or '(no description)'}",
            f"  why a person is asked: {question['why']}",
            f"  asked {question['asked_at']}, answer before {question['until']} (UTC, Redis clock)",
            f"  hash: {question['args_hash']}",
        ]
        lines += [f"  earlier answer: {_said(d)}" for d in question["decisions"]]
        lines += [
            f"  reverse now: {commands['reverse']}",
            f"  keep it:     {commands['keep']}",
            f"  ask later:   {commands['later']}",
        ]
        env.console.print("\n".join(lines), soft_wrap=True, markup=False, highlight=False)


def _said(decision: dict[str, Any]) -> str:
    note = f": {decision['note']}" if decision.get("note") else ""
    return f"{decision.get('decision', '?')} by {decision.get('by') or 'unknown'}{note}"
