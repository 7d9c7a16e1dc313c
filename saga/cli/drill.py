"""``saga drill``: play a scenario (or a recorded run, ``--from-run``; or a hosted agent played
by a fake model's script, ``--agent``) once clean and once per fault on a private Redis and a
real worker of the app, judge each run by the tools' systems (``verify``, else ``lookup``),
print the fault x outcome matrix; exit 1 on any mismatch (``saga.testing.drill``,
``saga.testing.drill_hosted``)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from saga.cli.context import Env, ExitCode, Failure

if TYPE_CHECKING:
    from saga.engine import Saga
    from saga.testing.drill_hosted import HostedScenario
    from saga.testing.drill_replay import RecordedCall

KINDS_HELP = (
    "fail_before_effect, fail_after_effect, killed_mid_effect, delivered_twice, "
    "undo_fails_once, undo_fails_after_effect, undo_fails_always, undo_killed_mid_effect, "
    "undo_delivered_twice, aborted_after, aborted_mid_effect, model_differs_on_replay "
    "(hosted agents: --agent)"
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
    "--agent",
    metavar="NAME",
    help="Drill a hosted agent of the app instead, its model played by --model-script.",
)
@click.option("--input", "input_text", metavar="TEXT", help="--agent: the run's input.")
@click.option(
    "--model-script",
    metavar="MODULE:ATTR",
    help="--agent: the model's answers, one per turn (a list of saga.testing.FakeModel steps: "
    "a final text, a (tool, arguments) call, a list of calls).",
)
@click.option(
    "--variants",
    metavar="MODULE:ATTR",
    help="--agent: {turn: answer}, what the model says when that turn is asked again "
    "(model_differs_on_replay); where none is given the drill makes one if it safely can.",
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
    agent: str | None,
    input_text: str | None,
    model_script: str | None,
    variants: str | None,
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
    aborted after each step and while each step's effect is under way. A hosted agent
    (--agent, --input, --model-script) meets the same on its steps, the drill approving what
    its run asks, and each model turn answered differently when asked again. Starts its own
    redis-server and worker (and, for an agent, a fake model its SDK client talks to); the
    app's systems are its own (point them at staging or fakes). Exit 1 on any mismatch
    between saga and the world."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.testing.drill import KINDS, Drill, DrillError, DrillReport
    from saga.testing.drill_report import to_json_text, to_markdown, to_text
    from saga.testing.drill_session import drill_session, load

    if not env.app_spec:
        raise Failure("saga drill needs the app: --app module:attr (or SAGA_APP)", ExitCode.USAGE)
    if sum(given is not None for given in (scenario, from_run, agent)) != 1:
        raise Failure(
            "saga drill needs one of --scenario MODULE:FUNCTION, --from-run RUN or --agent NAME",
            ExitCode.USAGE,
        )
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise Failure(f"unknown --fault {', '.join(unknown)}; known: {KINDS_HELP}", ExitCode.USAGE)
    _check_hosted(agent, input_text, model_script, variants, kinds)
    # The recorded run is read from this deployment, before the drill's own replaces it.
    calls = _recorded(env, from_run) if from_run is not None else []

    def say(line: str) -> None:
        click.echo(line, err=True)

    def drilled(drill: Drill) -> DrillReport:
        try:
            return drill.run(max_cases=max_cases, seed=seed, kinds=kinds or None)
        except DrillError as exc:
            raise Failure(f"drill: {exc}", ExitCode.BAD_STATE) from exc

    session = functools.partial(
        drill_session, env.app_spec, cwd=Path.cwd(), concurrency=concurrency, log=say
    )
    if agent is not None:
        # Imported on use: `saga --help` loads none of a command's imports.
        from saga.testing.drill_hosted import HOSTED_TIME_LIMIT, HostedDrill
        from saga.testing.fake_models import FakeModel

        model = FakeModel()
        made: list[HostedScenario] = []

        def prepare(saga: Saga) -> None:  # the app imported, its worker not yet started
            _hosts(agent, saga)
            made.append(_hosted_scenario(agent, input_text or "", model_script, variants, setup))

        with (
            model.serve() as url,
            session(env=FakeModel.environ(url), check=prepare, time_limit=HOSTED_TIME_LIMIT) as (
                saga,
                worker,
            ),
        ):
            say(f"drill: the fake model on {url}")
            report = drilled(
                HostedDrill(saga, made[0], model, timeout=timeout, progress=say, worker=worker)
            )
    else:
        with session() as (saga, worker):
            play = _scenario(scenario, from_run, calls, setup, load)
            report = drilled(Drill(saga, play, timeout=timeout, progress=say, worker=worker))
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


def _check_hosted(
    agent: str | None,
    input_text: str | None,
    model_script: str | None,
    variants: str | None,
    kinds: tuple[str, ...],
) -> None:
    """``--agent`` comes with ``--input`` and ``--model-script``, which come with nothing else;
    ``model_differs_on_replay`` strikes a model's turn: only an agent has one."""
    if agent is None:
        hosted = [
            f"--{n}"
            for n, v in (
                ("input", input_text),
                ("model-script", model_script),
                ("variants", variants),
            )
            if v is not None
        ]
        if hosted:
            raise Failure(f"{', '.join(hosted)}: only with --agent NAME", ExitCode.USAGE)
        if "model_differs_on_replay" in kinds:
            raise Failure(
                "--fault model_differs_on_replay strikes a model's turn: only with --agent NAME",
                ExitCode.USAGE,
            )
        return
    if input_text is None or model_script is None:
        raise Failure(
            "--agent needs --input TEXT and --model-script MODULE:ATTR (the model's answers)",
            ExitCode.USAGE,
        )
    for option, spec in (("--model-script", model_script), ("--variants", variants)):
        if spec is not None and ":" not in spec:
            raise Failure(f"{option} {spec!r}: name it as module:attr", ExitCode.USAGE)


def _hosted_scenario(
    agent: str,
    input_text: str,
    script_spec: str | None,
    variants_spec: str | None,
    setup_spec: str | None,
) -> HostedScenario:
    """The agent, its input and its model's script (and variants, and ``--setup``), loaded
    once the app is (they may import it)."""
    from collections.abc import Mapping, Sequence

    from saga.testing.drill_hosted import HostedScenario
    from saga.testing.drill_session import load

    def loaded(option: str, spec: str) -> Any:
        try:
            return load(spec, option)
        except ImportError as exc:
            raise Failure(f"{option} {spec!r}: {exc}", ExitCode.USAGE) from exc

    script = loaded("--model-script", script_spec or "")
    if isinstance(script, str | bytes) or not isinstance(script, Sequence) or not script:
        raise Failure(
            f"--model-script {script_spec!r} is not a list of the model's answers", ExitCode.USAGE
        )
    variants = loaded("--variants", variants_spec) if variants_spec else {}
    if not isinstance(variants, Mapping) or not all(isinstance(t, int) for t in variants):
        raise Failure(
            f"--variants {variants_spec!r} is not a {{turn: answer}} dict", ExitCode.USAGE
        )
    if setup_spec and ":" not in setup_spec:
        raise Failure(
            f"--setup {setup_spec!r}: name the function as module:function", ExitCode.USAGE
        )
    setup = loaded("--setup", setup_spec) if setup_spec else None
    if setup is not None and not callable(setup):
        raise Failure(f"--setup {setup_spec!r} is not a function", ExitCode.USAGE)
    return HostedScenario(agent, input_text, list(script), dict(variants), setup)


def _hosts(agent: str, saga: Saga) -> None:
    """That the app hosts ``agent`` (checked before the worker starts)."""
    names = sorted(a.name for a in saga.agents)
    if agent not in names:
        known = ", ".join(names) or "none"
        raise Failure(
            f"--agent {agent!r}: the app hosts no such agent (it hosts: {known})", ExitCode.USAGE
        )
