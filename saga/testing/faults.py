"""Failures injected into real workers, to exercise the code that only runs when something
already broke: compensations, redeliveries, escalations.

Rules live in Redis (``saga.constants.FAULTS_KEY``), so every worker process sees them, and
they only exist with ``SAGA_TESTING_FAULTS=1`` set in the test and in the worker alike.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterable

import redis

#: Where a fault can strike in a worker: around a tool's effect or a compensation, and in a
#: hosted turn (``tool`` is then the agent's name after the answer is recorded, and the
#: called tool's name after each call is dispatched), and once an escalation's row is written
#: (``tool`` is then ""), before its notices are.
FAULT_POINTS = (
    "before_effect",
    "after_effect",
    "before_compensation",
    "after_compensation",
    "during_model_call",
    "after_model_answer",
    "between_dispatches",
    "after_loop_ended",
    "after_escalation_recorded",
)
FAULTS_ENV = "SAGA_TESTING_FAULTS"

_HIT = """
local actions = {}
local rules = redis.call('HGETALL', KEYS[1])
for i = 1, #rules, 2 do
  local rule = cjson.decode(rules[i + 1])
  if rule.point == ARGV[1] and (rule.tool == '' or rule.tool == ARGV[2]) then
    local seen = redis.call('HINCRBY', KEYS[2], rules[i], 1)
    if seen >= rule.nth and seen < rule.nth + rule.times then
      table.insert(actions, rules[i + 1])
    end
  end
end
return actions
"""


def faults_enabled() -> bool:
    return os.environ.get(FAULTS_ENV) == "1"


class Faults:
    """Failures injected into real workers, configured through Redis so every worker process
    sees them: fail a tool's Nth call before or after its effect, fail a compensation N
    times, kill the worker at a named point, delay a step.

    It refuses to exist unless ``SAGA_TESTING_FAULTS=1`` is set, in the test and in the
    worker alike, so it cannot be switched on in production by a stray call.
    """

    def __init__(self, client: redis.Redis, known_tools: Iterable[str] | None = None) -> None:
        from saga.errors import FaultInjectionDisabledError

        if not faults_enabled():
            raise FaultInjectionDisabledError(
                f"fault injection is off: set {FAULTS_ENV}=1 (tests only, never production)"
            )
        self.client = client
        #: The tool names ``tool()`` checks a name against (a typo would make a rule that
        #: never strikes, and a test that passes for the wrong reason).
        self.known_tools = None if known_tools is None else sorted(known_tools)
        self._hit = client.register_script(_HIT)

    def fail(self, tool: str, *, nth: int = 1, times: int = 1, after_effect: bool = False) -> str:
        """Raise in ``tool`` on its ``nth`` call (and the ``times - 1`` after it)."""
        point = "after_effect" if after_effect else "before_effect"
        return self._add(point, tool, "raise", nth, times)

    def fail_compensation(self, tool: str, *, times: int = 1, nth: int = 1) -> str:
        return self._add("before_compensation", tool, "raise", nth, times)

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
            from saga.errors import UnknownToolError

            known = ", ".join(self.known_tools)
            raise UnknownToolError(f"no tool {name!r} to inject faults into; known: {known}")
        return ToolFaults(self, name)

    def hits(self, rule_id: str) -> int:
        from saga.constants import FAULT_COUNTS_KEY

        return int(self.client.hget(FAULT_COUNTS_KEY, rule_id) or 0)

    def clear(self) -> None:
        from saga.constants import FAULT_COUNTS_KEY, FAULTS_KEY

        self.client.delete(FAULTS_KEY, FAULT_COUNTS_KEY)

    def strike(self, point: str, tool: str) -> None:
        """Called by the worker at each point; acts on the rules that match this call."""
        from saga.constants import FAULT_COUNTS_KEY, FAULTS_KEY
        from saga.errors import InjectedFaultError

        for raw in self._hit(keys=[FAULTS_KEY, FAULT_COUNTS_KEY], args=[point, tool]):
            rule = json.loads(raw)
            if rule["action"] == "delay":
                time.sleep(rule["seconds"])
            elif rule["action"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif rule["action"] == "kill_worker":
                os.killpg(os.getpgid(0), signal.SIGKILL)
            else:
                raise InjectedFaultError(f"injected fault at {point} of {tool} ({rule['id']})")

    def _add(
        self, point: str, tool: str, action: str, nth: int, times: int, seconds: float = 0.0
    ) -> str:
        from saga.constants import FAULTS_KEY

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
    "before_compensation",
    "after_compensation",
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

    def fail_compensation(self, times: int = 1, *, nth: int = 1) -> str:
        """Raise in this compensation ``times`` times from its ``nth`` call: past its retries
        the run escalates; fewer, and the retries see it through."""
        return self.faults.fail_compensation(self.tool, times=times, nth=nth)

    def delay(self, seconds: float, *, at: str = "before_effect", nth: int = 1) -> str:
        """Sleep ``seconds`` at ``at`` (a slow system; a window for another fault)."""
        return self.faults.delay(self.tool, seconds, nth=nth, point=at)

    def hits(self, rule_id: str) -> int:
        """How many times the rule's point was reached (whether it struck or not)."""
        return self.faults.hits(rule_id)
