"""``saga tokens create|revoke|list``: the HTTP API's bearer tokens (``saga.web.tokens``),
kept hashed in the records database (SAGA_DATABASE_URL)."""

from __future__ import annotations

import click

from saga.cli.context import Env, ExitCode, Failure, emit_json, not_found, when
from saga.errors import TokenError


@click.group()
def tokens() -> None:
    """Bearer tokens for the HTTP API and the console (`saga serve`)."""


@tokens.command()
@click.option("--name", required=True, help="Who holds it: the `by` of what is done with it.")
@click.option(
    "--scope",
    type=click.Choice(["read", "operate"]),
    required=True,
    help="read: only reads; operate: may also abort, approve, deny, requeue and resolve.",
)
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.pass_obj
def create(env: Env, name: str, scope: str, as_json: bool) -> None:
    """Make a token and print it (once: only its hash is kept)."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.web import tokens as store

    try:
        token, info = store.create(env.records, name, scope)
    except TokenError as exc:
        raise Failure(str(exc), ExitCode.USAGE) from exc
    if as_json:
        emit_json({"token": token, "name": info.name, "scope": info.scope.value})
        return
    click.echo(token)
    click.echo(f"token {info.name!r} ({info.scope.value}): shown once, keep it safe", err=True)


@tokens.command()
@click.option("--name", required=True, help="The token's name.")
@click.pass_obj
def revoke(env: Env, name: str) -> None:
    """Revoke the token of this name: the very next request with it is refused."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.web import tokens as store

    try:
        store.revoke(env.records, name)
    except TokenError as exc:
        not_found(str(exc))
    env.console.print(f"token {name!r} revoked")


@tokens.command("list")
@click.option("--all", "everything", is_flag=True, help="Revoked tokens too.")
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.pass_obj
def list_(env: Env, everything: bool, as_json: bool) -> None:
    """The tokens' names, scopes and dates (never the tokens)."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.web import tokens as store

    found = store.list_tokens(env.records, revoked=everything)
    if as_json:
        items = [
            {
                "name": t.name,
                "scope": t.scope.value,
                "created_at": t.created_at.isoformat(),
                "revoked_at": t.revoked_at.isoformat() if t.revoked_at else None,
            }
            for t in found
        ]
        emit_json({"schema_version": 1, "tokens": items})
        return
    for t in found:
        revoked = f"  revoked {when(t.revoked_at.timestamp())}" if t.revoked_at else ""
        click.echo(f"{t.name}\t{t.scope.value}\tcreated {when(t.created_at.timestamp())}{revoked}")
