"""``saga runs`` and ``saga show RUN``: read-only, from the URLs alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import click

from saga.cli.context import Env, emit_json, not_found, parse_since, when
from saga.model import RunState
from saga.validation import check_run_id

# Types only: a command imports these on use (``saga --help`` loads none of them).
if TYPE_CHECKING:
    from rich.table import Table

    from saga.cli.queries import RunRow

#: Widest a word may make its column (a longer one is folded): tool names, reasons' words.
_WORD_MAX = 24
_STYLE = {"completed": "green", "compensated": "green", "escalated": "red", "unwinding": "yellow"}


@click.command()
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice([s.value for s in RunState]),
    help="Only runs in this state (repeatable).",
)
@click.option("--agent", help="Only runs of this hosted agent.")
@click.option("--tool", help="Only runs that called this tool.")
@click.option(
    "--since", callback=parse_since, help="Only runs started since: 30m, 2h, 7d or an ISO date."
)
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.pass_obj
def runs(
    env: Env,
    states: tuple[str, ...],
    agent: str | None,
    tool: str | None,
    since: float | None,
    limit: int,
    as_json: bool,
) -> None:
    """List runs, newest first: live ones from Redis, ended ones from the records."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from rich.text import Text

    from saga.cli.queries import RunFilter, list_runs
    from saga.listing import with_tools

    where = RunFilter(states=states, agent=agent, tool=tool, since=since, limit=limit)
    store = env.store_if_reachable()
    rows = list_runs(store, env.records, where)
    if store is not None:  # the steps column: a listing reads them only to filter by tool
        rows = with_tools(store, rows)
    if as_json:
        emit_json({"schema_version": 1, "runs": [r.to_dict() for r in rows]})
        return
    env.console.print(runs_table(rows) if rows else Text("no runs match", style="dim"))


def runs_table(rows: Sequence[RunRow]) -> Table:
    """The listing: ids, states and times never wrap; the tools and the reason wrap between
    words (each column at least as wide as its longest word), never inside one."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from rich.table import Table
    from rich.text import Text

    # The footer explains the "open esc." column, so only when some row has one.
    caption = (
        "open escalation: saga escalation show RUN:N" if any(r.escalation for r in rows) else None
    )
    table = Table(caption=caption, caption_justify="left")
    table.add_column("run", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("agent", no_wrap=True)
    table.add_column("started (UTC)", no_wrap=True)
    tools = [", ".join(r.tools) for r in rows]
    reasons = [r.reason for r in rows]
    table.add_column("steps", min_width=_longest_word(tools), overflow="fold")
    table.add_column("reason", min_width=_longest_word(reasons), overflow="fold")
    table.add_column("open esc.", no_wrap=True)
    for row, steps, reason in zip(rows, tools, reasons, strict=True):
        table.add_row(
            row.run_id,
            Text(row.state, style=_STYLE.get(row.state, "")),
            row.agent,
            when(row.created),
            steps,
            reason,
            f":{row.escalation.rpartition(':')[2]}" if row.escalation else "",
        )
    return table


def _longest_word(cells: Sequence[str]) -> int | None:
    words = [len(word) for cell in cells for word in cell.split()]
    return min(max(words), _WORD_MAX) if words else None


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option("--json", "as_json", is_flag=True, help="The run document (schema version 1).")
@click.pass_obj
def show(env: Env, run_id: str, as_json: bool) -> None:
    """Draw a run's timeline: forward steps with their classes and pushes, the pivot line,
    the unwind with ✓/✗, how it ended."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.cli.queries import run_doc
    from saga.escalations import run_card, run_json

    check_run_id(run_id)
    doc = run_doc(env.store_if_reachable(), env.records, run_id)
    if doc is None:
        not_found(f"no run {run_id} (never started, or expired and never recorded)")
    if as_json:
        emit_json(run_json(doc))
        return
    env.console.print(run_card(doc), crop=False)
    for escalation in env.records.escalations(run_id, open_only=True):
        env.console.print(  # one line, however long: it is a command to copy
            f"\nescalation {escalation.escalation_id} is open: "
            f"{env.command()} escalation show {escalation.escalation_id}",
            soft_wrap=True,
        )
