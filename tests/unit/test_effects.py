"""What a step records of an effect that cannot be recorded as it is (``saga.effects``): the
problem, by type, beside an undo built from the tool's real result. No broker, no Redis."""

from __future__ import annotations

import json
from typing import Any

from saga.effects import RESULT_PROBLEM, UNDO_PROBLEM, encode_effect
from saga.model import ToolClass, Undo
from saga.tools import ToolRegistry

registry = ToolRegistry()


class Credit:
    """A client library's answer: an object, not JSON."""

    def __init__(self, credit_id: str) -> None:
        self.credit_id = credit_id


@registry.compensation()
def reverse_credit(credit_id: str) -> None: ...


@registry.tool(
    ToolClass.COMPENSATABLE_WRITE,
    compensation=lambda args, result: Undo("reverse_credit", {"credit_id": result["creditid"]}),
)
def credit_with_typo(amount_cents: int) -> dict[str, Any]:
    return {"credit_id": "cr-1"}


@registry.tool(
    ToolClass.COMPENSATABLE_WRITE,
    compensation=lambda args, result: Undo("reverse_credit", {"credit_id": result.credit_id}),
)
def credit_as_object(amount_cents: int) -> Credit:
    return Credit("cr-2")


@registry.tool(ToolClass.READ)
def read_everything() -> dict[str, Any]:
    return {}


def encode(tool: str, result: Any, limit: int = 1000) -> tuple[str, str, Any]:
    return encode_effect(registry, limit, registry.get(tool), "r1", 1, {"amount_cents": 5}, result)


def test_a_compensation_that_raises_is_named_by_its_own_error() -> None:
    result_json, entry_json, problem = encode("credit_with_typo", {"credit_id": "cr-1"})
    message = "the compensation could not be built: KeyError 'creditid'"
    assert problem == {"type": UNDO_PROBLEM, "message": message}
    assert json.loads(result_json) == {"credit_id": "cr-1"}  # the result is kept as it came
    entry = json.loads(entry_json)
    assert (entry["broken"], entry["tool"], entry["description"]) == (True, "", message)


def test_a_result_that_is_not_json_keeps_the_undo_built_from_the_real_result() -> None:
    result_json, entry_json, problem = encode("credit_as_object", Credit("cr-2"))
    assert problem is not None and problem["type"] == RESULT_PROBLEM
    assert problem["message"].startswith("result of credit_as_object is not JSON")
    assert json.loads(result_json) == {"unrecorded": problem["message"]}
    assert json.loads(entry_json)["args"] == {"credit_id": "cr-2"}


def test_a_result_over_the_limit_is_a_result_problem_and_a_fine_one_none() -> None:
    _, entry_json, problem = encode("read_everything", {"lines": "x" * 2000})
    assert problem == {
        "type": RESULT_PROBLEM,
        "message": "result of read_everything is 2012 bytes, over the limit of 1000 bytes",
    }
    assert entry_json == ""  # a read pushes no undo
    assert encode("read_everything", {"lines": "x"})[2] is None
