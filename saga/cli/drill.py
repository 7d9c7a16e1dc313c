"""``saga drill``: play a scenario once clean and once per fault on a private Redis and a real
worker of the app, judge each run by the tools' systems (``verify``, else ``lookup``), print
the fault x outcome matrix; exit 1 on any mismatch (``saga.testing.drill``)."""

from __future__ import annotations

from pathlib import Path

import click

from saga.cli.context import Env, ExitCode, Failure

KINDS_HELP = (
    "fail_before_effect, fail_after_effect, killed_mid_effect, undo_fails_once, "
    "undo_fails_after_effect, undo_fails_always, aborted_after"
)


@click.command()
@click.option(
    "--scenario",
    required=True,
    metavar="MODULE:FUNCTION",
    help="A function taking a Run and making its calls (run.call(...).result(...)).",
)
@click.option("--max-cases", type=click.IntRange(0), help="Play at most N fault cases, sampled.")
@click.option("--seed", type=int, default=0, show_default=True, help="The sampling's seed.")
@click.option("--fault", "kinds", multiple=True, help=f"Only these kinds (repeat): {KINDS_HELP}.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the JSON here.")
@click.option(
    "--markdown", "markdown_path", type=click.Path(path_type=Path), help="Write Markdown here."
)
@click.option("--timeout", type=float, default=60.0, show_default=True, help="Seconds per run.")
@click.option("--concurrency", type=click.IntRange(1, 16), default=2, show_default=True)
@click.pass_obj
def drill(
    env: Env,
    scenario: str,
    max_cases: int | None,
    seed: int,
    kinds: tuple[str, ...],
    json_path: Path | None,
    markdown_path: Path | None,
    timeout: float,
    concurrency: int,
) -> None:
    """Replay SCENARIO against the app (--app) once per fault: each step failing before and
    after its effect and killed mid-effect, each undo failing once and always, the run aborted
    after each step. Starts its own redis-server and worker; the app's systems are its own
    (point them at staging or fakes). Exit 1 on any mismatch between saga and the world."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.testing.drill import KINDS, Drill, DrillError
    from saga.testing.drill_report import to_json_text, to_markdown, to_text
    from saga.testing.drill_session import drill_session, load

    if not env.app_spec:
        raise Failure("saga drill needs the app: --app module:attr (or SAGA_APP)", ExitCode.USAGE)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise Failure(f"unknown --fault {', '.join(unknown)}; known: {KINDS_HELP}", ExitCode.USAGE)

    def say(line: str) -> None:
        click.echo(line, err=True)

    with drill_session(env.app_spec, cwd=Path.cwd(), concurrency=concurrency, log=say) as (
        saga,
        worker,
    ):
        play = load(scenario, "--scenario")
        if not callable(play):
            raise Failure(f"--scenario {scenario!r} is not a function", ExitCode.USAGE)
        try:
            report = Drill(saga, play, timeout=timeout, progress=say, worker=worker).run(
                max_cases=max_cases, seed=seed, kinds=kinds or None
            )
        except DrillError as exc:
            raise Failure(f"drill: {exc}", ExitCode.BAD_STATE) from exc
    click.echo(to_text(report))
    if json_path is not None:
        json_path.write_text(to_json_text(report))
    if markdown_path is not None:
        markdown_path.write_text(to_markdown(report))
    if not report.ok:
        raise click.exceptions.Exit(int(ExitCode.BAD_STATE))
