"""The testing kit's side of fault injection: the rules a test writes for real workers, to
exercise the code that only runs when something already broke: compensations, redeliveries,
escalations. The points production code checks are ``saga.fault_points``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable

import redis

from saga.constants import FAULT_COUNTS_KEY, FAULTS_KEY
from saga.errors import UnknownToolError
from saga.fault_points import FAULT_POINTS, FAULTS_ENV, FaultPoints, faults_enabled

__all__ = ["FAULTS_ENV", "FAULT_POINTS", "TOOL_POINTS", "Faults", "ToolFaults", "faults_enabled"]


class Faults(FaultPoints):
    """Failures injected into real workers, configured through Redis so every worker process
    sees them: fail a tool's Nth call before or after its effect, fail a compensation N
    times, kill the worker at a named point, delay a step.

    It refuses to exist unless ``SAGA_TESTING_FAULTS=1`` is set, in the test and in the
    worker alike, so it cannot be switched on in production by a stray call.
    """

    def __init__(self, client: redis.Redis, known_tools: Iterable[str] | None = None) -> None:
        super().__init__(client)
        #: The tool names ``tool()`` checks a name against (a typo would make a rule that
        #: never strikes, and a test that passes for the wrong reason).
        self.known_tools = None if known_tools is None else sorted(known_tools)

    def fail(self, tool: str, *, nth: int = 1, times: int = 1, after_effect: bool = False) -> str:
        """Raise in ``tool`` on its ``nth`` call (and the ``times - 1`` after it)."""
        point = "after_effect" if after_effect else "before_effect"
        return self._add(point, tool, "raise", nth, times)

    def fail_compensation(
        self, tool: str, *, times: int = 1, nth: int = 1, after_effect: bool = False
    ) -> str:
        """Raise in the compensation ``tool`` (``after_effect``: once its effect happened)."""
        point = "after_compensation" if after_effect else "before_compensation"
        return self._add(point, tool, "raise", nth, times)

    def kill(self, point: str, tool: str = "", *, nth: int = 1, whole_worker: bool = False) -> str:
        """SIGKILL the pool process (or the whole worker) when ``point`` is reached."""
        return self._add(point, tool, "kill_worker" if whole_worker else "kill", nth, 1)

    def delay(
        self,
        tool: str,
        seconds: float,
        *,
        nth: int = 1,
        times: int = 1,
        point: str = "before_effect",
    ) -> str:
        """Sleep ``seconds`` at ``point`` of ``tool`` (by default, before its effect)."""
        return self._add(point, tool, "delay", nth, times, seconds)

    def tool(self, name: str) -> ToolFaults:
        """The faults of one tool, by what a test means."""
        if self.known_tools is not None and name not in self.known_tools:
            known = ", ".join(self.known_tools)
            raise UnknownToolError(f"no tool {name!r} to inject faults into; known: {known}")
        return ToolFaults(self, name)

    def hits(self, rule_id: str) -> int:
        return int(self.client.hget(FAULT_COUNTS_KEY, rule_id) or 0)

    def clear(self) -> None:
        self.client.delete(FAULTS_KEY, FAULT_COUNTS_KEY)

    def _add(
        self, point: str, tool: str, action: str, nth: int, times: int, seconds: float = 0.0
    ) -> str:
        if point not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {point!r}; known: {', '.join(FAULT_POINTS)}")
        if nth < 1 or times < 1:
            raise ValueError("nth and times must be at least 1")
        rule_id = uuid.uuid4().hex[:12]
        rule = {"id": rule_id, "point": point, "tool": tool, "action": action, "nth": nth}
        rule.update(times=times, seconds=seconds)
        self.client.hset(FAULTS_KEY, rule_id, json.dumps(rule))
        return rule_id


#: The points of ``FAULT_POINTS`` that belong to one tool's task (or to its dispatch by a turn).
TOOL_POINTS = (
    "before_effect",
    "after_effect",
    "after_push",
    "before_compensation",
    "after_compensation",
    "after_compensation_failed",
    "between_dispatches",
)


class ToolFaults:
    """One tool's failures, named for what they test. Each method returns the rule's id (for
    ``hits``); ``nth`` counts the tool's calls at that point across every worker, from 1."""

    def __init__(self, faults: Faults, tool: str) -> None:
        self.faults = faults
        self.tool = tool

    def fail_before_effect(self, *, nth: int = 1, times: int = 1) -> str:
        """Raise before the effect: the step fails (or is retried) and nothing happened."""
        return self.faults.fail(self.tool, nth=nth, times=times)

    def fail_after_effect(self, *, nth: int = 1, times: int = 1) -> str:
        """Raise after the effect: it happened, the step still fails (the lookup's case)."""
        return self.faults.fail(self.tool, nth=nth, times=times, after_effect=True)

    def kill_worker(self, at: str = "before_effect", *, nth: int = 1, whole: bool = False) -> str:
        """SIGKILL the pool process running the tool at ``at`` (``whole``: the whole worker,
        whose message then waits for the visibility timeout; restart the worker)."""
        if at not in TOOL_POINTS:
            raise ValueError(f"at={at!r} is not a point of a tool; known: {', '.join(TOOL_POINTS)}")
        return self.faults.kill(at, self.tool, nth=nth, whole_worker=whole)

    def fail_compensation(self, times: int = 1, *, nth: int = 1, after_effect: bool = False) -> str:
        """Raise in this compensation ``times`` times from its ``nth`` call: past its retries
        the run escalates; fewer, and the retries see it through. ``after_effect``: raise once
        the undo's effect happened (its retry must meet the same idempotency key)."""
        return self.faults.fail_compensation(
            self.tool, times=times, nth=nth, after_effect=after_effect
        )

    def delay(self, seconds: float, *, at: str = "before_effect", nth: int = 1) -> str:
        """Sleep ``seconds`` at ``at`` (a slow system; a window for another fault)."""
        return self.faults.delay(self.tool, seconds, nth=nth, point=at)

    def hits(self, rule_id: str) -> int:
        """How many times the rule's point was reached (whether it struck or not)."""
        return self.faults.hits(rule_id)
