"""``saga indexes`` and ``saga indexes reshard``: how the store's cross-run indexes are
sharded (``saga.constants.IndexLayout``), and moving them to another shard count.

Every process of a deployment must shard the indexes as the store records (a worker refuses to
start otherwise), so a change of ``SAGA_INDEX_SHARDS`` is a migration: stop every worker, beat
and caller, run ``reshard``, start them with the new setting.
"""

from __future__ import annotations

import click

from saga.cli.context import Env, bad_state, emit_json

#: A reaper pass more recent than this says beat and a worker still run.
_LIVE_PASS = 120.0


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.pass_context
def indexes(ctx: click.Context, as_json: bool) -> None:
    """The cross-run indexes' shards (the reaper's, the listing's, the approvals'): how many,
    and how many runs each holds."""
    if ctx.invoked_subcommand is not None:
        return
    env: Env = ctx.obj
    store = env.store
    recorded = store.recorded_layout().shards
    sizes = store.index_sizes()
    configured = env.settings.index_layout().shards
    if as_json:
        emit_json({"recorded": recorded, "configured": configured, "sizes": sizes})
    else:
        env.console.print(f"shards: {recorded} recorded, {configured} configured here")
        for kind, counts in sizes.items():
            env.console.print(f"{kind}: {sum(counts)} ({', '.join(map(str, counts))})")
    if recorded != configured:
        bad_state(
            f"this process is configured for {configured} shard(s) (SAGA_INDEX_SHARDS), the "
            f"store's indexes have {recorded}: set it, or `saga indexes reshard`"
        )


@indexes.command()
@click.option("--shards", type=click.IntRange(1, 1024), required=True, help="The new count.")
@click.option("--force", is_flag=True, help="Even though a reaper pass was seen just now.")
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.pass_obj
def reshard(env: Env, shards: int, force: bool, as_json: bool) -> None:
    """Move every index entry to SHARDS shards and record the new count. Run it with every
    worker, beat and caller stopped; then start them with SAGA_INDEX_SHARDS=SHARDS. Safe to
    run again if it was interrupted."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.constants import IndexLayout

    store = env.store
    last = store.last_reaper_pass()
    if last is not None and store.now() - last < _LIVE_PASS and not force:
        bad_state(
            f"the reaper finished a pass {store.now() - last:.0f} s ago: beat and a worker "
            "still run, and would index runs where no one reads; stop them (or --force)"
        )
    before = store.recorded_layout().shards
    moved = store.reshard(IndexLayout(shards))
    if as_json:
        emit_json({"from": before, "to": shards, "moved": moved})
        return
    env.console.print(
        f"indexes: {before} -> {shards} shard(s); moved "
        + ", ".join(f"{n} {kind}" for kind, n in moved.items())
    )
