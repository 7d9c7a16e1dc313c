"""The package as a terminal card (rich): what ``saga escalation show`` and the demo print.

The timeline in it is ``timeline``'s drawing, segment for segment, with its styles.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from saga.escalations.markdown import compact, database_why
from saga.escalations.questions import unanswered, unanswered_text
from saga.escalations.schema import AnswerCommandsDoc, CompensationDoc, EscalationDoc, RunDoc
from saga.escalations.timeline import Line, timeline, undo_text

_STATE_STYLE = {
    "succeeded": "green",
    "done": "green",
    "completed": "green",
    "compensated": "green",
    "failed": "red",
    "escalated": "red bold",
    "in_doubt": "yellow",
}


def timeline_text(lines: list[Line]) -> Text:
    """The timeline's segments as one rich ``Text`` (no wrapping: the columns must hold)."""
    text = Text(no_wrap=True, overflow="ignore")
    for i, line in enumerate(lines):
        if i:
            text.append("\n")
        for segment, style in line:
            text.append(segment, style=style or None)
    return text


def run_card(doc: RunDoc) -> RenderableType:
    """A run: its header, then its timeline (``saga show`` and the demo)."""
    header = Text.assemble(
        ("run ", "dim"),
        (doc["run_id"], "bold"),
        ("  ", ""),
        (doc["state"], _STATE_STYLE.get(doc["state"], "")),
    )
    if doc["agent"]:
        header.append(f"  agent {doc['agent']}", style="dim")
    details = [f"created {doc['created_at'] or '?'}"]
    if doc["ended_at"]:
        details.append(f"ended {doc['ended_at']}")
    if doc["cause"]:
        details.append(f"cause: {doc['cause']}")
    if doc["source"] == "database":
        details.append(f"read from the database: {database_why(doc)}")
    return Group(
        header, Text("  ·  ".join(details), style="dim"), Text(), timeline_text(timeline(doc))
    )


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD)
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _steps(doc: RunDoc) -> Table:
    table = _table(
        "Steps", "#", "tool", "class", "arguments", "result / error", "attempts", "state"
    )
    for s in doc["steps"]:
        if s["state"] == "succeeded":
            outcome = compact(s["result"], 60)
        else:
            error = s["error"] or {}
            outcome = f"{error.get('type', '')}: {error.get('message', '')}".strip(": ")
        table.add_row(
            str(s["step"]),
            s["tool"],
            f"{s['tool_class']} {s['class_name']}",
            compact(s["args"], 60),
            outcome,
            str(s["attempts"]),
            Text(s["state"], style=_STATE_STYLE.get(s["state"], "")),
        )
    return table


def _failed(comp: CompensationDoc) -> RenderableType:
    undo = comp["undo"]
    what = undo_text(undo, 80)
    title = (
        f"✗ step {comp['step']}: {what}: {comp['attempts']} attempt(s), {comp['rounds']} round(s)"
    )
    table = _table(title, "attempt", "at", "error")
    for e in comp["errors"]:
        table.add_row(str(e["attempt"] or ""), e["at"] or "", f"{e['type']}: {e['message']}")
    if not comp["errors"]:
        table.add_row("", "", "(no error kept)")
    return table


def to_rich(doc: EscalationDoc) -> RenderableType:
    """The whole package as a card: why up top, the timeline, then the detail and commands."""
    status = "open" if doc["open"] else f"resolved: {doc['resolution']}"
    why = doc["why"]
    head = Text()
    head.append(why["reason"] or why["kind"], style="bold red")
    if why["also"]:
        head.append(f"  (also: {', '.join(why['also'])})", style="yellow")
    head.append(f"\n{why['summary']}")
    if doc["cause"]:
        head.append(f"\ncause: {doc['cause']}", style="bold")
    if doc["moved_on"]:
        head.append(f"\nsince: {doc['moved_on']}", style="cyan")
    parts: list[RenderableType] = [
        Panel(head, title=f"ESCALATION {doc['escalation_id']} · {status}", title_align="left"),
        *_questions(doc),
        run_card(doc["run"]),
        _steps(doc["run"]),
    ]
    stack = _table("Stack (captured references)", "step", "undo", "arguments", "idempotency key")
    for e in doc["stack"]:
        stack.add_row(str(e["step"]), e["tool"], compact(e["args"], 80), e["idempotency_key"])
    parts.append(stack if doc["stack"] else Text("Stack: empty", style="dim"))
    parts += [_failed(c) for c in doc["failed_compensations"]]
    live = _table("Still live in the world", "step", "tool", "result", "why")
    for item in doc["live"]:
        live.add_row(str(item["step"]), item["tool"], compact(item["result"], 80), item["why"])
    parts.append(live if doc["live"] else Text("Still live: nothing", style="dim"))
    parts.append(_commands(doc))
    return Group(*parts)


def _questions(doc: EscalationDoc) -> list[RenderableType]:
    """What a person is asked now (the run waits at an undo), with the commands that answer
    it; and each question that expired unanswered, which is why the run escalated."""
    parts: list[RenderableType] = []
    answers = {a["step"]: a for a in doc["commands"]["answer_reversal"]}
    for question in doc["run"]["questions"]:
        text = Text()
        text.append(f"step {question['step']}: {question['description']}\n", style="bold")
        text.append(f"undo   {question['tool']}({compact(question['args'], 200)})\n")
        text.append(f"why    {question['why']}\n")
        text.append(f"asked  {question['asked_at'] or '?'}, answer before ")
        text.append(f"{question['until'] or '?'}\n", style="bold")
        text.append(f"hash   {question['args_hash']}")
        for earlier in question["decisions"]:
            text.append(f"\nearlier: {earlier.get('decision')} by {earlier.get('by')}", style="dim")
        title = "A PERSON DECIDES: reverse, keep or later"
        parts.append(Panel(text, title=title, title_align="left", border_style="yellow"))
        answer = answers.get(question["step"])
        if answer is not None:
            parts.append(_answer_commands(answer))
    for comp in unanswered(doc["failed_compensations"]):
        line = Text("Asked and not answered: ", style="bold red")
        line.append(unanswered_text(comp))
        parts.append(line)
    return parts


def _answer_commands(answer: AnswerCommandsDoc) -> RenderableType:
    """One question's answers, one per line, never wrapped (each copied whole)."""
    text = Text(no_wrap=True, overflow="ignore")
    rows = [
        ("reverse", answer["reverse"]),
        ("keep", answer["keep"]),
        ("later", answer["later"]),
        ("api", answer["api"]),
    ]
    for label, command in rows:
        text.append(f"{label:>8}  ", style="dim")
        text.append(f"{command}\n", style="bold")
    text.rstrip()
    return text


def _commands(doc: EscalationDoc) -> RenderableType:
    """The commands, one per line and never wrapped (however narrow the terminal), so that
    each can be copied whole; not in a panel, whose border would cut them."""
    commands = doc["commands"]
    rows: list[tuple[str, Any]] = [
        ("requeue", commands["requeue"]),
        ("correct", commands["requeue_with_correction"]),
        ("resolve", commands["resolve"]),
        ("show", commands["show"]),
    ]
    text = Text(no_wrap=True, overflow="ignore")
    text.append("Commands\n", style="bold")
    for label, command in rows:
        if command:
            text.append(f"{label:>8}  ", style="dim")
            text.append(f"{command}\n", style="bold")
    if not any(command for _, command in rows):
        text.append("(nothing to do)")
    text.rstrip()
    return text
