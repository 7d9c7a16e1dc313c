"""``saga db upgrade`` and ``saga db status``: the records' schema (``saga.records.migrations``).

``upgrade`` is what a deployment runs as a one-shot step before its workers start (with
``SAGA_DB_AUTO_UPGRADE=0`` the workers then only check); it is idempotent and locked, so running
it beside workers that upgrade by themselves is harmless too.
"""

from __future__ import annotations

import click

from saga.cli.context import Env, bad_state, emit_json, mask


@click.group()
def db() -> None:
    """The records database's schema: upgrade it to this version's head, or say where it is."""


@db.command()
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.pass_obj
def upgrade(env: Env, as_json: bool) -> None:
    """Bring the records database (SAGA_DATABASE_URL) to this version's head."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.records import migrations

    url = env.settings.database_url
    before, head = migrations.status(url)
    migrations.upgrade(url)
    after, _ = migrations.status(url)
    if as_json:
        emit_json({"database": mask(url), "from": before, "to": after, "head": head})
        return
    moved = "already at" if before == after else f"{before or 'empty'} ->"
    env.console.print(f"{mask(url)}: {moved} {after}", soft_wrap=True)


@db.command()
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.pass_obj
def status(env: Env, as_json: bool) -> None:
    """Say the records database's revision and this version's head (exit 1 if they differ)."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.records import migrations

    url = env.settings.database_url
    current, head = migrations.status(url)
    if as_json:
        emit_json({"database": mask(url), "current": current, "head": head})
    else:
        env.console.print(
            f"{mask(url)}: at {current or 'no revision'}, head {head}", soft_wrap=True
        )
    if current != head:
        bad_state(f"the records database is not at head: run `{env.command()} db upgrade`")
