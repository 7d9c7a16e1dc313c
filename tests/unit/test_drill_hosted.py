"""The hosted drill's pieces without a worker: the fake model answering a replayed ask with its
variant, the variants the drill makes, the turn cases it plans, and its judgment of a replayed
turn and of the approvals a run asked."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from saga import StepContext, ToolClass, ToolRegistry, Undo
from saga.agents.messages import ModelTurn, ToolCall
from saga.agents.turn_state import args_hash
from saga.cli.main import cli
from saga.model import StepState
from saga.picture import StepRecord
from saga.testing.drill_judge import CaseResult
from saga.testing.drill_plan import Fault
from saga.testing.drill_turns import (
    AGAIN,
    Approvals,
    judge_approvals,
    judge_replay,
    made_variant,
    plan_turns,
    shown_hash,
)
from saga.testing.fake_models import Answered, FakeModel, ModelFailure, httpx

ORDER = ("get_order", {"order_id": 7})
CREDIT = ("credit", {"order_id": 7, "cents": 100})
REPLY = ("reply", {"body": "hi"})
REPLY_2 = ("reply", {"body": "hello"})


def _saga() -> Any:
    tools = ToolRegistry()

    @tools.tool(ToolClass.READ)
    def get_order(order_id: int) -> int:
        return order_id

    def undo(args: dict[str, Any], result: Any) -> Undo:
        return Undo("uncredit", {"order_id": args["order_id"]})

    @tools.tool(ToolClass.COMPENSATABLE_WRITE, compensation=undo)
    def credit(ctx: StepContext, order_id: int, cents: int) -> int:
        return cents

    @tools.compensation()
    def uncredit(order_id: int) -> None:
        return None

    @tools.tool(ToolClass.IRREVERSIBLE_WRITE)
    def reply(ctx: StepContext, body: str) -> str:
        return body

    agent = SimpleNamespace(approval=frozenset({"reply"}))
    return SimpleNamespace(registry=tools, agents=SimpleNamespace(get=lambda name: agent))


def _ask(model: FakeModel, answers: int) -> dict[str, Any]:
    """A Chat Completions request carrying ``answers`` answers of the model."""
    messages = [{"role": "user", "content": "go"}]
    messages += [{"role": "assistant", "content": "..."}] * answers
    request = httpx.Request(
        "POST", "http://fake/v1/chat/completions", content=json.dumps({"messages": messages})
    )
    body: dict[str, Any] = model.handle(request).json()
    return body["choices"][0]["message"]


def test_the_fake_model_answers_a_replayed_ask_with_its_variant() -> None:
    # Given a script whose first answer has a variant for a second ask
    model = FakeModel()
    model.play([[ORDER], "done"], replays={0: [CREDIT]})

    # When the first answer is asked for twice, then the second once
    first, again, last = _ask(model, 0), _ask(model, 0), _ask(model, 1)

    # Then the second ask got the variant, and the log says which ask got what
    assert first["tool_calls"][0]["function"]["name"] == "get_order"
    assert again["tool_calls"][0]["function"]["name"] == "credit"
    assert last["content"] == "done"
    assert [(a.index, a.again) for a in model.answered] == [(0, False), (0, True), (1, False)]
    assert model.asks(0)[1].calls == (CREDIT,)

    # And a new play starts the count over, with no variant unless given
    model.play([[ORDER]])
    assert _ask(model, 0)["tool_calls"][0]["function"]["name"] == "get_order"
    assert _ask(model, 0)["tool_calls"][0]["function"]["name"] == "get_order"


@pytest.mark.parametrize(
    ("step", "variant"),
    [
        ("done", "done" + AGAIN),
        ([ORDER, CREDIT], [CREDIT, ORDER]),  # parallel calls reordered
        ([ORDER], None),  # one call: another call or argument is the scenario's to choose
        ([CREDIT, REPLY], None),  # reordered, the irreversible reply would go out first
        ([ORDER, ("nope", {})], None),  # an unknown tool: what it is, nobody can say
        ([ORDER, ORDER], None),  # the same answer reordered
        (ModelFailure(500), None),
        (lambda body: "done", None),
    ],
)
def test_the_drill_makes_a_variant_only_where_it_is_safe(step: Any, variant: Any) -> None:
    assert made_variant(step, _saga()) == variant


def test_a_turn_case_is_planned_per_turn_with_a_variant_and_the_others_are_noted() -> None:
    script = [[ORDER, CREDIT], [REPLY], "done"]
    faults, variants, notes = plan_turns(
        "helper",
        [1, 2, 3],
        script,
        {3: "done"},
        _saga(),  # turn 3's "variant" is no variant
    )
    assert [f.name for f in faults] == ["model_differs_on_replay @ turn 1 (helper)"]
    assert (faults[0].nth, faults[0].turn) == (1, 1)
    assert variants == {1: [CREDIT, ORDER]}
    assert len(notes) == 2
    assert "turn 2 not planned: no safe variant" in notes[0]
    assert "turn 3 not planned: its variant is the answer itself" in notes[1]


def _picture(answers: dict[int, ModelTurn], steps: list[StepRecord], **more: str) -> Any:
    fields = {"name": "helper", "input": "go", **more}
    for turn, answer in answers.items():
        fields[f"{turn}:answer"] = json.dumps(answer.to_dict())
    return SimpleNamespace(run_id="r1", agent=fields, steps=steps)


def _turn(*calls: tuple[str, dict[str, Any]], text: str = "") -> ModelTurn:
    return ModelTurn(
        calls=tuple(ToolCall(f"c{i}", n, a) for i, (n, a) in enumerate(calls)), text=text
    )


def _step(step: int, call: tuple[str, dict[str, Any]], marker: str) -> StepRecord:
    kind = ToolClass.IRREVERSIBLE_WRITE if call[0] == "reply" else ToolClass.READ
    return StepRecord(step, call[0], kind, dict(call[1]), StepState.SUCCEEDED, 1, call=marker)


def _replayed(picture: Any, asks: list[Answered]) -> list[str]:
    result = CaseResult(Fault("model_differs_on_replay", tool="helper", nth=2, turn=2))
    judge_replay(_saga(), picture, asks, result)
    return [str(m) for m in result.mismatches]


ASKS = [Answered(1, False, (REPLY,)), Answered(1, True, (REPLY_2,))]


def test_a_replayed_turn_that_recorded_and_ran_the_second_answer_is_no_mismatch() -> None:
    picture = _picture(
        {1: _turn(ORDER), 2: _turn(REPLY_2)}, [_step(1, ORDER, "1:0"), _step(2, REPLY_2, "2:0")]
    )
    assert _replayed(picture, ASKS) == []


def test_a_replayed_turn_that_kept_the_first_answer_is_named() -> None:
    picture = _picture({2: _turn(REPLY)}, [_step(1, REPLY, "2:0")])
    found = _replayed(picture, ASKS)
    assert "recorded the first, lost answer (reply({'body': 'hi'})), not the second" in found[0]
    assert found[1] == (
        "model_differs_on_replay @ turn 2 (helper): step 1 (reply): call 2:0 of the first, "
        "lost answer ran: reply({'body': 'hi'})"
    )


def test_a_turn_never_asked_again_tested_nothing() -> None:
    picture = _picture({2: _turn(REPLY)}, [])
    [found] = _replayed(picture, ASKS[:1])
    assert found == (
        "model_differs_on_replay @ turn 2 (helper): turn 2 was not asked again after its "
        "answer was lost (the model answered 1 ask(s) for it): the case tested nothing"
    )


def test_a_call_that_went_out_is_judged_by_the_approval_the_drill_gave() -> None:
    reply = ToolCall("c0", *REPLY_2)
    request = {"tool": "reply", "arguments": REPLY_2[1], "args_hash": args_hash(reply)}
    decision = {"verdict": "approved", "args_hash": args_hash(reply), "by": "saga drill"}
    assert shown_hash(request) == args_hash(reply)
    picture = _picture(
        {1: _turn(REPLY_2)},
        [_step(1, REPLY_2, "1:0")],
        **{"1:0:approval": json.dumps(request), "1:0:decision": json.dumps(decision)},
    )

    def judged(given: set[tuple[str, str]]) -> list[str]:
        result = CaseResult(Fault("none"))
        judge_approvals(_saga(), picture, "helper", Approvals(given=given), result)
        return [m.what for m in result.mismatches]

    # Approved by the drill for these very arguments: no mismatch
    assert judged({("1:0", args_hash(reply))}) == []
    # An approval the drill never gave (for the first answer's arguments, say): reused
    assert judged({("1:0", args_hash(ToolCall("c0", *REPLY)))}) == [
        "it went out on an approval the drill never gave for these arguments (reused)"
    ]


def test_the_command_checks_a_hosted_drill_s_options_before_it_starts_anything() -> None:
    def usage(*args: str) -> str:
        result = CliRunner().invoke(cli, ["drill", "--app", "m:s", *args])
        assert result.exit_code == 2, result.output
        return result.output

    assert "one of --scenario" in usage("--agent", "helper", "--scenario", "m:f")
    assert "--agent needs --input TEXT and --model-script" in usage("--agent", "helper")
    assert "--input: only with --agent" in usage("--scenario", "m:f", "--input", "hi")
    assert "only with --agent NAME" in usage(
        "--scenario", "m:f", "--fault", "model_differs_on_replay"
    )
    assert "name it as module:attr" in usage(
        "--agent", "helper", "--input", "hi", "--model-script", "nocolon"
    )
    shown = CliRunner().invoke(cli, ["drill", "--help"]).output
    assert "--model-script" in shown and "model_differs_on_replay" in shown


def test_a_turn_asked_again_is_planned_only_where_the_wait_for_the_fence_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import redis

    from saga.testing.drill_hosted import HostedDrill, HostedScenario

    monkeypatch.setenv("SAGA_TESTING_FAULTS", "1")
    saga = _saga()
    saga.store = SimpleNamespace(client=redis.Redis())  # never connected: no rule is written
    saga.app = SimpleNamespace(conf={"task_soft_time_limit": 4})
    scenario = HostedScenario("helper", "go", [[ORDER], "done"])

    def why(pool: str, soft: int) -> str:
        saga.app.conf["task_soft_time_limit"] = soft
        worker: Any = SimpleNamespace(pool=pool)
        return HostedDrill(saga, scenario, FakeModel(), worker=worker)._too_short()

    # A prefork pool's soft limit of 4 s (the kit's default 5 s limit) ends the delivery first
    assert "past the worker's soft time limit (4 s)" in why("prefork", 4)
    assert why("prefork", 7) == ""  # the 8 s limit saga drill --agent gives its worker
    assert why("threads", 4) == ""  # a threads pool has no time limit
