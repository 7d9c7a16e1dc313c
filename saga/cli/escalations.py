"""``saga escalations`` and ``saga escalation show ID``: read-only, from the URLs alone."""

from __future__ import annotations

import inspect

import click

from saga.cli.context import Env, emit_json, not_found, parse_escalation_id, parse_since


def corrections_supported() -> bool:
    """Whether this version's requeue takes corrections (``--set``): read off the signature of
    the operation behind it (``saga.operations``, which needs no Celery)."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.operations import requeue

    return accepts(requeue, "corrections")


def accepts(function: object, name: str) -> bool:
    """``function`` takes keyword ``name`` (by name, or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(function).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return name in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


@click.command()
@click.option("--all", "everything", is_flag=True, help="Resolved ones too (default: open only).")
@click.option("--run", "run_id", metavar="RUN", help="Only this run's.")
@click.option("--since", callback=parse_since, help="Only those since: 30m, 2h, 7d or an ISO date.")
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.pass_obj
def escalations(
    env: Env, everything: bool, run_id: str | None, since: float | None, as_json: bool
) -> None:
    """List escalations, newest first (open ones unless --all)."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from rich.table import Table
    from rich.text import Text

    from saga.cli.queries import escalation_rows, escalation_summary
    from saga.escalations.document import iso_datetime

    rows = escalation_rows(env.records, open_only=not everything, run_id=run_id, since=since)
    if as_json:
        items = [escalation_summary(r) for r in rows]
        emit_json({"schema_version": 1, "escalations": items})
        return
    table = Table()
    table.add_column("escalation", no_wrap=True)
    for column in ("reason", "cause", "escalated (UTC)", "live", "failed undos", "state"):
        table.add_column(column, overflow="fold")
    for r in rows:
        table.add_row(
            r.escalation_id,
            Text(r.reason, style="red"),
            r.cause,
            (iso_datetime(r.created_at) or "").replace("T", " ").removesuffix("+00:00"),
            str(len(r.not_undone)),
            str(len(r.failed_compensations)),
            "open" if not r.resolved else f"resolved: {r.resolution}",
        )
    env.console.print(table if rows else Text("no escalations match", style="dim"))


@click.group()
def escalation() -> None:
    """One escalation."""


@escalation.command("show")
@click.argument("escalation_id", metavar="ID", callback=parse_escalation_id)
@click.option("--markdown", "fmt", flag_value="markdown", help="Markdown, to paste in a ticket.")
@click.option("--json", "fmt", flag_value="json", help="The package (schema version 1).")
@click.pass_obj
def show_escalation(env: Env, escalation_id: str, fmt: str | None) -> None:
    """The escalation package: why, the timeline, each step, the stack, each failed
    compensation with every attempt's error, what is still live, and the commands."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.cli.queries import escalation_doc
    from saga.escalations import to_json, to_markdown, to_rich

    store = env.store_if_reachable()
    doc = escalation_doc(
        store,
        env.records,
        escalation_id,
        command=env.command(store),
        corrections=corrections_supported(),
    )
    if doc is None:
        not_found(f"no escalation {escalation_id} (`saga escalations --all` lists them)")
    if fmt == "json":
        click.echo(to_json(doc))
    elif fmt == "markdown":
        click.echo(to_markdown(doc))
    else:
        env.console.print(to_rich(doc), crop=False)
