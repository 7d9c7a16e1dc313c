"""``saga drill``: play a scenario (or a recorded run, ``--from-run``) once clean and once per
fault on a private Redis and a real worker of the app, judge each run by the tools' systems
(``verify``, else ``lookup``), print the fault x outcome matrix; exit 1 on any mismatch
(``saga.testing.drill``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from saga.cli.context import Env, ExitCode, Failure

if TYPE_CHECKING:
    from saga.testing.drill_replay import RecordedCall

KINDS_HELP = (
    "fail_before_effect, fail_after_effect, killed_mid_effect, delivered_twice, "
    "undo_fails_once, undo_fails_after_effect, undo_fails_always, undo_killed_mid_effect, "
    "undo_delivered_twice, aborted_after, aborted_mid_effect"
)


@click.command()
@click.option(
    "--scenario",
    metavar="MODULE:FUNCTION",
    help="A function taking a Run and making its calls (run.call(...).result(...)).",
)
@click.option(
    "--from-run",
    "from_run",
    metavar="RUN",
    help="Replay a recorded run instead: its steps' tools and arguments, in order, read from "
    "SAGA_REDIS_URL while its keys live, else from the records (SAGA_DATABASE_URL).",
)
@click.option(
    "--setup",
    metavar="MODULE:FUNCTION",
    help="Called (no arguments) before each play: a known world for every case.",
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
    scenario: str | None,
    from_run: str | None,
    setup: str | None,
    max_cases: int | None,
    seed: int,
    kinds: tuple[str, ...],
    json_path: Path | None,
    markdown_path: Path | None,
    timeout: float,
    concurrency: int,
) -> None:
    """Replay SCENARIO (or the recorded run RUN) against the app (--app) once per fault: each
    step failing before and after its effect, killed mid-effect and delivered twice; each undo
    failing once, after its effect and always, killed mid-effect and delivered twice; the run
    aborted after each step and while each step's effect is under way. Starts its own
    redis-server and worker; the app's systems are its own (point them at staging or fakes).
    Exit 1 on any mismatch between saga and the world."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.testing.drill import KINDS, Drill, DrillError
    from saga.testing.drill_report import to_json_text, to_markdown, to_text
    from saga.testing.drill_session import drill_session, load

    if not env.app_spec:
        raise Failure("saga drill needs the app: --app module:attr (or SAGA_APP)", ExitCode.USAGE)
    if (scenario is None) == (from_run is None):
        raise Failure(
            "saga drill needs --scenario MODULE:FUNCTION or --from-run RUN", ExitCode.USAGE
        )
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise Failure(f"unknown --fault {', '.join(unknown)}; known: {KINDS_HELP}", ExitCode.USAGE)
    # The recorded run is read from this deployment, before the drill's own replaces it.
    calls = _recorded(env, from_run) if from_run is not None else []

    def say(line: str) -> None:
        click.echo(line, err=True)

    with drill_session(env.app_spec, cwd=Path.cwd(), concurrency=concurrency, log=say) as (
        saga,
        worker,
    ):
        play = _scenario(scenario, from_run, calls, setup, load)
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


def _recorded(env: Env, run_id: str) -> list[RecordedCall]:
    """The calls of ``run_id`` as this deployment's Redis or records hold them."""
    from saga.errors import InvalidRunIdError
    from saga.testing.drill_replay import RecordedRunError, recorded_calls
    from saga.validation import check_run_id

    try:
        check_run_id(run_id)
        return recorded_calls(env.store_if_reachable(), env.records, run_id)
    except InvalidRunIdError as exc:
        raise Failure(f"--from-run: {exc}", ExitCode.USAGE) from exc
    except RecordedRunError as exc:
        raise Failure(f"--from-run: {exc}", ExitCode.NOT_FOUND) from exc
    finally:
        env.close()


def _scenario(
    spec: str | None,
    run_id: str | None,
    calls: list[RecordedCall],
    setup_spec: str | None,
    load: Any,
) -> Any:
    """What the drill plays: the function named, or the recorded calls; ``--setup`` first."""
    from saga.testing.drill_replay import Replay, with_setup

    if setup_spec and ":" not in setup_spec:
        raise Failure(
            f"--setup {setup_spec!r}: name the function as module:function", ExitCode.USAGE
        )
    setup = load(setup_spec, "--setup") if setup_spec else None
    if setup is not None and not callable(setup):
        raise Failure(f"--setup {setup_spec!r} is not a function", ExitCode.USAGE)
    if run_id is not None:
        return Replay(run_id, calls, setup=setup)
    play = load(spec, "--scenario")
    if not callable(play):
        raise Failure(f"--scenario {spec!r} is not a function", ExitCode.USAGE)
    return play if setup is None else with_setup(setup, play)
