"""The points where a test may make a worker fail, as production code checks them.

The worker, the hosted loop and the recording of an escalation each call ``strike`` at their
points; it is a no-op object unless ``SAGA_TESTING_FAULTS=1`` is set, in the test and in the
worker alike. The rules live in Redis (``saga.constants.FAULTS_KEY``), so every worker process
sees them; ``saga.testing.Faults`` is the testing kit that writes them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import redis

from saga.constants import FAULT_COUNTS_KEY, FAULTS_KEY
from saga.errors import FaultInjectionDisabledError, InjectedFaultError
from saga.redis_errors import unavailable

#: Where a fault can strike in a worker: around a tool's effect or a compensation; once a
#: step's success and its undo are recorded, its message not yet acknowledged
#: (``after_push``); once a compensation raised, before its retry or failure is recorded
#: (``after_compensation_failed``: saga's time, not the tool's); in a hosted turn (``tool``
#: is then the agent's name while the model is asked, once it answered and before the answer
#: is recorded (``after_model_call``: a death there makes the redelivered turn ask again), and
#: after the answer is recorded; and the called tool's name after each call is dispatched);
#: once an unwind's conclusion is written in Redis, before its SQL record is
#: (``after_conclusion``); and once an escalation's row is written (``tool`` is "" for these
#: two), before its notices are.
FAULT_POINTS = (
    "before_effect",
    "after_effect",
    "after_push",
    "before_compensation",
    "after_compensation",
    "after_compensation_failed",
    "during_model_call",
    "after_model_call",
    "after_model_answer",
    "between_dispatches",
    "after_loop_ended",
    "after_conclusion",
    "after_escalation_recorded",
)
FAULTS_ENV = "SAGA_TESTING_FAULTS"

logger = logging.getLogger("saga.testing")

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


class FaultPoints:
    """Acts on the rules that match a point a worker reached.

    It refuses to exist unless ``SAGA_TESTING_FAULTS=1`` is set, so it cannot be switched on in
    production by a stray call.
    """

    def __init__(self, client: redis.Redis) -> None:
        if not faults_enabled():
            raise FaultInjectionDisabledError(
                f"fault injection is off: set {FAULTS_ENV}=1 (tests only, never production)"
            )
        self.client = client
        self._hit = client.register_script(_HIT)

    def strike(self, point: str, tool: str) -> None:
        """Called by the worker at each point; acts on the rules that match this call.

        Redis away (a test that kills it or fails it over) strikes nothing: the rules cannot be
        read, and the point must not fail in a way no production worker, which has no points,
        ever would."""
        try:
            hits = self._hit(keys=[FAULTS_KEY, FAULT_COUNTS_KEY], args=[point, tool])
        except redis.RedisError as exc:
            if not unavailable(exc):
                raise
            logger.warning(
                "fault point %s of %r: rules unreadable (%s); none struck", point, tool, exc
            )
            return
        for raw in hits:
            rule = json.loads(raw)
            if rule["action"] == "delay":
                time.sleep(rule["seconds"])
            elif rule["action"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif rule["action"] == "kill_worker":
                os.killpg(os.getpgid(0), signal.SIGKILL)
            else:
                raise InjectedFaultError(f"injected fault at {point} of {tool} ({rule['id']})")
