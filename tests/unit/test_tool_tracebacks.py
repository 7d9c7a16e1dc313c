"""What a tool raised is reported from the tool's own code on: the frames ``call_tool``
called, not saga's delivery above them (``saga.delivery.from_the_tool``; the worker's log of a
real failure is checked in ``tests/integration/test_saga.py``).
"""

from __future__ import annotations

import dataclasses
import traceback
from types import TracebackType
from typing import Any

import pytest

from saga.delivery import call_tool, from_the_tool
from saga.errors import InvalidArgumentsError
from saga.model import StepContext, ToolClass
from saga.tools import ToolRegistry

CTX = StepContext("run", 1, "run:1", 1)


class MailboxFull(Exception):
    pass


def _deliver_from_saga(registry: ToolRegistry, name: str, args: dict[str, Any]) -> Any:
    """A frame of saga's standing in for its delivery above ``call_tool``."""
    return call_tool(registry.get(name), CTX, args)


def _frames(tb: TracebackType | None) -> list[str]:
    return [frame.name for frame in traceback.extract_tb(tb)]


@pytest.fixture
def registry() -> ToolRegistry:
    reg = ToolRegistry()

    def smtp_send(to: str) -> None:
        mailboxes: dict[str, int] = {}
        try:
            mailboxes[to]  # a failure the tool's own failure is raised from
        except KeyError as missing:
            raise MailboxFull(f"{to}: full") from missing

    @reg.tool(ToolClass.IRREVERSIBLE_WRITE)
    def send_reply(to: str) -> None:
        smtp_send(to)

    return reg


def caught(registry: ToolRegistry, args: dict[str, Any]) -> BaseException:
    with pytest.raises(Exception) as raised:
        _deliver_from_saga(registry, "send_reply", args)
    return raised.value


def test_a_tools_failure_is_its_frames_from_the_tool_on(registry: ToolRegistry) -> None:
    exc = caught(registry, {"to": "ada@example.com"})

    # The whole traceback goes through saga's frames; the tool's part starts at the tool.
    assert _frames(exc.__traceback__)[-4:] == [
        "_deliver_from_saga",
        "call_tool",
        "send_reply",
        "smtp_send",
    ]
    assert _frames(from_the_tool(exc)) == ["send_reply", "smtp_send"]


def test_reraised_from_the_tool_it_keeps_its_type_message_and_cause(
    registry: ToolRegistry,
) -> None:
    def task() -> None:  # as the worker's tool task body re-raises it
        try:
            _deliver_from_saga(registry, "send_reply", {"to": "ada@example.com"})
        except Exception as exc:
            tool_frames = from_the_tool(exc)
            assert tool_frames is not None
            raise exc.with_traceback(tool_frames)  # noqa: B904 - the same exception

    with pytest.raises(MailboxFull, match=r"ada@example\.com: full") as raised:
        task()

    exc = raised.value
    assert _frames(exc.__traceback__)[-3:] == ["task", "send_reply", "smtp_send"]
    assert "_deliver_from_saga" not in _frames(exc.__traceback__)
    assert isinstance(exc.__cause__, KeyError) and exc.__suppress_context__
    printed = "".join(traceback.format_exception(exc))
    assert "direct cause of the following exception" in printed and "KeyError" in printed


def test_what_did_not_come_out_of_the_tool_is_not_shown_as_the_tools(
    registry: ToolRegistry,
) -> None:
    # Refused before the tool ran: reported from saga's argument check (what call_tool
    # called first), with no frame of the tool's.
    refused = caught(registry, {"to": 3, "cc": "x"})
    assert isinstance(refused, InvalidArgumentsError)
    assert "send_reply" not in _frames(from_the_tool(refused))

    # Raised by saga itself, not through call_tool: no part of it is the tool's.
    try:
        raise RuntimeError("the store refused the step")
    except RuntimeError as own:
        assert from_the_tool(own) is None

    # A call call_tool could not make (the function's own signature refused it, in
    # call_tool's frame): nothing below call_tool, so it is reported whole.
    unfit = dataclasses.replace(registry.get("send_reply"), func=lambda: None)
    with pytest.raises(TypeError) as raised:
        call_tool(unfit, CTX, {"to": "ada@example.com"})
    unmade = raised.value
    assert isinstance(unmade, TypeError)
    assert from_the_tool(unmade) is None
