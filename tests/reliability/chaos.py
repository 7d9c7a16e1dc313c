"""The randomised chaos run: many small sagas, random kill points, three workers, invariants.

    python -m tests.reliability.chaos --runs 200 --seed 1 [--hosted-share 0.25]
        [--store sentinel|cluster] [--broker amqp|split]

It starts a private ``redis-server``, two Celery tool workers on ``tests.reliability.chaos_app``
and a turn worker (``-P threads -c 20 -Q saga.turns``) and, in this process, a ``Saga`` on the
same Redis that plays the agent: each run is 4-6 steps chosen under the pivot rules, with a
fault plan drawn from ``random.Random(seed)`` (the same seed gives the same plans; their digest
is printed). A share of the runs (``--hosted-share``, default a quarter) are hosted agent runs
instead: enqueued as a web app would (``saga.client.Client.enqueue_run``), played on the turn
worker by ``chaos_app.chaos_policy``, a scripted model whose script is the run's steps in 2-4
turns (several calls in one answer sometimes; sometimes the irreversible call asked for a turn
too early, beside a write: it must be refused, and is asked for again). Their plans add kills
of the turn worker: inside the model call, before its answer is recorded; once the answer is
recorded; after the nth dispatch of a turn; and whole-turn-worker kills sent by a step, from
outside, whatever turns the worker is playing. A supervisor restarts a worker that was killed
whole (the turn worker too) and runs the reaper; once every run has ended, the invariants are
checked against the tools' own side-effect ledger (``chaos_app``), not the saga's records:

- every run ends completed, compensated or escalated, none stuck running or unwinding;
- each write's effect is kept (completed run, or escalated with the step listed as live) or
  undone exactly once; undos run in reverse order, and never undo what never happened;
- an irreversible effect never sits in a compensated run;
- every failed compensation is in an escalation record; nothing fails silently.

And for hosted runs, against the policy's own count of its calls per (run, turn):

- at most one model call per turn whose answer was recorded: exactly one, plus one for each
  earlier call made in a turn worker that was killed before the answer was kept. Such kills
  are accounted exactly: the policy logs the pid of each call, the supervisor the pid of
  each turn worker that died, and every call before the one whose answer was recorded must
  have been made by a dead one (the plan's kills inside the model call, or a kill of the whole
  turn worker that caught another run's model call); the recorded answer must be the last
  call's. A turn asked without an answer is only the last one (the model gave up there, or
  every asker died and the run ended meanwhile);
- each call of a recorded answer got at most one step, the one its place in the script says,
  and the early irreversible call none (it was refused);
- the loop's counters (``<k>:asked``, ``model_calls``) and the SQL transcript agree with the
  policy's count and the recorded turns.

``--store sentinel`` puts the store, the broker and the results on a master, a replica and
three sentinels of the run's own (replica confirmation on), failed over every
``--failover-every`` seconds; the tools' ledger then lives on the plain Redis, which no failover
touches. ``--store cluster`` puts the store alone on a Redis Cluster of the run's own (three
masters, a replica each, ``redis_cluster.RedisClusterNodes``; replica confirmation on), the
broker on a plain Redis of its own (a cluster cannot be one) and the ledger and the results on
the plain Redis; every ``--failover-every`` seconds a random master is failed over, in turn by
a ``CLUSTER FAILOVER`` on its replica and by a SIGKILL (its replica promoted; the killed node
started again at once, back as a replica, the cluster healthy again before the next fault).
``--broker split`` puts the broker and the results on a Redis of their own without persistence,
killed and started again empty every ``--broker-fault-every`` seconds: every message queued
then is lost, and the reaper sends it again from the store at its run's deadline
(``docs/deployment.md``, "The broker on a Redis of its own").
``--broker amqp`` puts the broker on a RabbitMQ node of the run's own
(``rabbit_node.RabbitNode``), whose client connections are all closed, or which is restarted,
every ``--broker-fault-every`` seconds. The agent retries what a failover refuses, as a caller
told ``StoreUnavailableError`` is retryable should; a call the broker refused (nothing sent)
makes it abort the run.

It prints its figures; the last line is ``chaos: N runs, K kills, V violations`` and the exit
status is 1 when V > 0.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.reliability.chaos_app"
#: Above the time limit plus any chaos tool's longest retry delay plus the guard's margin
#: (5 + 0.2 + 1 s: the start-up guard checks it),
#: short enough that a message stranded by a whole-worker kill comes back within seconds
#: (chaos_app makes the workers sweep for such messages every second).
VISIBILITY_TIMEOUT = 10
TIME_LIMIT = 5
#: Run deadlines: most runs outlast a stranded message (it comes back, the run goes on); some
#: are shorter, so the reaper resolves the run first and the stranded message comes back to a
#: run already resolved, as in production (deadline 900 s, visibility timeout 1200 s).
LONG_DEADLINE = 20
SHORT_DEADLINE = 5
#: A hosted run's long deadline: a killed turn worker's turn comes back after the visibility
#: timeout, once the worker is restarted; most hosted runs outlast that, as most runs outlast
#: a stranded message.
HOSTED_DEADLINE = 40
#: ``Chaos.longest_of``'s entry for a killed master: how long until its replica was promoted.
PROMOTED = "masters killed, until the replica's promotion"

# -- plans ------------------------------------------------------------------------------------

#: What a run's fault plan does, and how often (weights add up to 100).
KINDS: list[tuple[str, int]] = [
    ("clean", 17),
    ("transient_fail", 10),  # a step fails 1-2 times (before or after its effect), then works
    ("fail", 16),  # a step fails for good: unwind (sometimes with a broken compensation)
    ("kill_before", 9),  # the pool process dies before a step's effect, once
    ("kill_after", 11),  # ... after the effect, before the push, once
    ("kill_unwind", 8),  # a step fails for good, then a compensation's process dies, once
    ("crash_loop", 4),  # the pool process dies every time: the step ends in doubt
    ("worker_kill", 5),  # the whole worker dies (forward or mid-unwind); it is restarted
    ("abort", 7),  # the agent aborts after a few steps
    ("abandon", 3),  # the agent walks away; the reaper resolves the run
    ("pivot_fail", 7),  # something fails after the irreversible step: escalate
    # The whole worker dies in a compensation; the reaper resumes the unwind, where that
    # compensation fails for good; then the stranded message comes back.
    ("undo_stranded", 3),
]
#: Hosted runs: the same kinds (no "abandon": a hosted run's agent cannot walk away; its
#: "abort" is the model giving up), plus kills of the turn worker (weights add up to 100).
HOSTED_KINDS: list[tuple[str, int]] = [
    ("clean", 4),
    ("transient_fail", 5),
    ("fail", 10),
    ("kill_before", 4),
    ("kill_after", 5),
    ("kill_unwind", 4),
    ("crash_loop", 2),
    ("worker_kill", 4),
    ("abort", 6),
    ("pivot_fail", 5),
    ("undo_stranded", 2),
    ("turn_kill_model", 11),  # the turn worker dies in the model call, before the answer is kept
    ("turn_kill_answer", 10),  # ... once the answer is recorded, before any dispatch
    ("turn_kill_dispatch", 10),  # ... after its nth dispatch of a turn
    ("turn_worker_kill", 10),  # a step SIGKILLs the whole turn worker, whatever it is doing
    # One model call outlasts the asking lease and the visibility timeout (the turn's message
    # comes back while it runs), sometimes with the same run enqueued again meanwhile, and
    # half the time the turn worker dies in it once the lease would have run out unrenewed.
    ("turn_long_model", 8),
]
TURN_KINDS = {
    "turn_kill_model",
    "turn_kill_answer",
    "turn_kill_dispatch",
    "turn_worker_kill",
    "turn_long_model",
}
#: A chaos turn's asking lease: the tool time limit plus the lease margin (``Saga.lease_seconds``,
#: below ``saga.agents.lease.TURN_LEASE_SECONDS``). A long model call thinks 1.4-2x as long.
TURN_LEASE = TIME_LIMIT + 2.0
#: How long a question about a costly refund waits for the operator (``answer_questions``)
#: before it expires into an escalation; "later" puts it off as long again.
ASK_SECONDS = 6
#: What the operator answers, by weight (seeded per run and step): "never" lets it expire;
#: "later" is followed by "reverse" the next time the question is seen.
ANSWERS = (("reverse", 40), ("keep", 25), ("later", 15), ("never", 20))
#: Kinds whose faults are all recoverable: the run should complete.
RECOVERABLE = {"clean", "transient_fail", "kill_before", "kill_after", *TURN_KINDS}
PRE_PIVOT = (["peek", "tag", "put", "charge"], [2, 1, 3, 3])
COMPENSATABLE = {"put", "charge"}
WRITES = {"tag", "put", "charge", "notify"}


def _args(rng: random.Random, index: int, step: int, tool: str) -> dict[str, Any]:
    base = index * 10
    if tool == "peek":
        return {"slot": base + rng.randint(0, 1)}
    if tool == "tag":
        return {"slot": base + 5 + rng.randint(0, 1), "value": f"t{index}.{step}"}
    if tool == "put":  # two slots per run, so undo order shows in the slot's final value
        return {"slot": base + rng.randint(0, 1), "value": f"v{index}.{step}"}
    if tool == "charge":
        return {"account": f"acct-{index}-{rng.randint(0, 1)}", "cents": rng.randint(1, 9999)}
    return {"to": f"user-{index}@example.com"}


def _fault(point: str, times: int = 1, **extra: Any) -> dict[str, Any]:
    """Act at ``point`` ("before"/"after" the effect) on ``times`` calls (from the ``nth``)."""
    return {"point": point, "times": times, **extra}


def _undo_fault(rng: random.Random, steps: list[int]) -> dict[str, dict[str, Any]]:
    """A fault in the compensation of one of ``steps`` (compensatable steps that will unwind)."""
    if not steps:
        return {}
    k = rng.choice(steps)
    which = rng.choice(
        ["transient", "transient", "broken", "broken", "kill_before", "kill_after", "loop"]
    )
    if which == "transient":
        return {f"cfail:{k}": _fault("before", rng.randint(1, 2))}
    if which == "broken":
        if rng.random() < 0.3:
            return {f"cfail:{k}": _fault("before", 1, final=True)}
        return {f"cfail:{k}": _fault("before", 3)}
    if which == "loop":
        return {f"ckill:{k}": _fault(rng.choice(["before", "after"]), 99)}
    return {f"ckill:{k}": _fault(which.removeprefix("kill_"))}


def operator_answer(seed: int, run_id: str, step: int, said: list[str]) -> str:
    """What the chaos operator answers to the question about ``step``'s undo, having answered
    ``said`` already: seeded per run and step; after "later", "reverse"."""
    if said and said[-1] == "later":
        return "reverse"
    names, weights = zip(*ANSWERS, strict=True)
    return random.Random(f"{seed}:{run_id}:{step}").choices(names, weights)[0]


def make_plan(rng: random.Random, index: int, hosted_share: float = 0.0) -> dict[str, Any]:
    """One run: its steps (obeying the pivot rules), its faults, what the agent does; for a
    hosted run also its turns (``_turns``)."""
    hosted = rng.random() < hosted_share
    names, weights = zip(*(HOSTED_KINDS if hosted else KINDS), strict=True)
    kind = rng.choices(names, weights)[0]
    n = rng.randint(4, 6)
    shape = rng.random()
    if kind == "pivot_fail" or shape < 0.15:
        tail = ["notify", rng.choice(["peek", "tag"])]
    elif shape < 0.5:
        tail = ["notify"]
    else:
        tail = []
    pre = rng.choices(*PRE_PIVOT, k=n - len(tail))
    # At least two compensatable writes, so every unwind has an order to get wrong.
    while sum(t in COMPENSATABLE for t in pre) < 2:
        pre[rng.randrange(len(pre))] = rng.choice(sorted(COMPENSATABLE))
    if kind == "pivot_fail":
        tail[1] = "tag"
    tools = pre + tail
    steps = [{"tool": t, "args": _args(rng, index, s, t)} for s, t in enumerate(tools, 1)]
    pivot = tools.index("notify") + 1 if "notify" in tools else None
    last_unwindable = pivot or n  # a failure past the pivot escalates instead of unwinding
    comp = [s for s, t in enumerate(tools, 1) if t in COMPENSATABLE]
    faults: dict[str, dict[str, Any]] = {}
    agent: dict[str, int] = {}
    deadline = "long"
    any_step = rng.randint(1, n)
    point = rng.choice(["before", "after"])
    if kind == "transient_fail":
        faults[f"fail:{any_step}"] = _fault(point, rng.randint(1, 2))
    elif kind in ("fail", "kill_unwind"):
        low = comp[0] + 1 if kind == "kill_unwind" else 2
        j = rng.randint(low, last_unwindable if kind == "kill_unwind" else n)
        final = rng.random() < 0.3
        faults[f"fail:{j}"] = _fault("before", 1 if final else 3, final=final)
        unwound = [s for s in comp if s < j] if j <= last_unwindable else []
        if kind == "kill_unwind":
            k = rng.choice(unwound)
            faults[f"ckill:{k}"] = _fault(rng.choice(["before", "after"]))
        elif rng.random() < 0.5:
            faults.update(_undo_fault(rng, unwound))
    elif kind == "kill_before":
        faults[f"kill:{any_step}"] = _fault("before")
    elif kind == "kill_after":
        faults[f"kill:{any_step}"] = _fault("after")
    elif kind == "crash_loop":
        if rng.random() < 0.25:
            j = rng.randint(comp[0] + 1, last_unwindable)
            faults[f"fail:{j}"] = _fault("before", 3)
            k = rng.choice([s for s in comp if s < j])
            faults[f"ckill:{k}"] = _fault(point, 99)
        else:
            faults[f"kill:{any_step}"] = _fault(point, 99)
    elif kind == "worker_kill":
        deadline = rng.choice(["long", "short"])
        if rng.random() < 0.4:
            j = rng.randint(comp[0] + 1, last_unwindable)
            faults[f"fail:{j}"] = _fault("before", 3)
            k = rng.choice([s for s in comp if s < j])
            faults[f"ckill:{k}"] = _fault(point, whole_worker=True)
        else:
            faults[f"kill:{any_step}"] = _fault(point, whole_worker=True)
    elif kind == "abort":
        after = rng.randint(2, n - 1)
        agent["abort_after"] = after
        if rng.random() < 0.4 and (pivot is None or pivot > after):
            faults.update(_undo_fault(rng, [s for s in comp if s <= after]))
    elif kind == "undo_stranded":
        deadline = "short"
        k = rng.choice(comp[1:])  # an older compensation runs after it in the unwind
        if k < last_unwindable:
            faults[f"fail:{rng.randint(k + 1, last_unwindable)}"] = _fault("before", 3)
        else:
            agent["abort_after"] = n
        faults[f"ckill:{k}"] = _fault("before", whole_worker=True)
        faults[f"cfail:{k}"] = _fault("before", 2, nth=2)  # the resumed unwind's attempts
    elif kind == "abandon":
        agent["abandon_after"] = rng.randint(1, n - 1)
    elif kind == "pivot_fail":
        assert pivot is not None
        if rng.random() < 0.7:
            faults[f"fail:{pivot + 1}"] = _fault("before", 3)
        else:
            faults[f"kill:{pivot}"] = _fault("after", 99)
    # A redelivered or retried step must leave exactly one undo behind, which only an unwind
    # shows: often, a later step then fails for good.
    then = ""
    redelivered = kind in ("transient_fail", "kill_before", "kill_after") or (
        kind == "worker_kill" and f"kill:{any_step}" in faults
    )
    if redelivered and any_step < n and rng.random() < 0.4:
        j = rng.randint(any_step + 1, n)
        if f"fail:{j}" not in faults:
            faults[f"fail:{j}"] = _fault("before", 3)
            then = "fail"
    plan = {
        "kind": kind,
        "then": then,
        "deadline": deadline,
        "steps": steps,
        "faults": faults,
        "agent": agent,
    }
    if hosted:
        plan["hosted"] = _turns(rng, plan, tools, pivot)
    return plan


def _turns(
    rng: random.Random, plan: dict[str, Any], tools: list[str], pivot: int | None
) -> dict[str, Any]:
    """A hosted run's script: the steps in 2-4 turns of consecutive steps (several calls in
    one answer run in parallel; 5 turns where two puts on one slot must be kept apart), the
    irreversible call alone or beside reads only, a write after it in a later turn; sometimes
    that call is asked for a turn too early, beside a write (it must be refused, and the script
    asks for it again in its own turn). Also: where the model gives up (the plan's abort), how
    long it thinks, and the turn worker's kills."""
    n = len(tools)
    required = set()
    if pivot is not None:
        required.add(pivot - 1)  # a cut after step pivot - 1: nothing written beside notify
        if pivot < n and tools[pivot] == "tag":
            required.add(pivot)
    # Two puts on one slot never share a turn: parallel calls run in any order, and such
    # writes do not commute (neither would their undos, taken in reverse step order).
    slots: set[int] = set()
    for s, step in enumerate(plan["steps"], 1):
        if s - 1 in required:
            slots = set()
        if step["tool"] == "put":
            if step["args"]["slot"] in slots:
                required.add(s - 1)
                slots = set()
            slots.add(step["args"]["slot"])
    free = [p for p in range(1, n) if p not in required]
    low = max(2, len(required) + 1)
    count = rng.randint(low, max(low, min(4, n)))
    cuts = sorted(required | set(rng.sample(free, count - 1 - len(required))))
    bounds = [0, *cuts, n]
    turns = [list(range(a + 1, b + 1)) for a, b in itertools.pairwise(bounds)]
    early = None
    if pivot is not None:
        at = next(t for t, steps in enumerate(turns) if pivot in steps)
        before = turns[at - 1]
        if rng.random() < 0.5 and any(tools[s - 1] in WRITES for s in before):
            early = {"turn": at, "at": rng.randint(0, len(before))}
    give_up = None
    after = plan["agent"].pop("abort_after", None)
    if after is not None:  # the model gives up at the first turn after that many steps
        give_up = next(t for t, steps in enumerate(turns, 1) if steps[-1] >= after) + 1
    kind, faults = plan["kind"], plan["faults"]
    last = len(turns) + 1  # the turn of the final answer
    if kind == "turn_kill_model":
        turn = rng.randint(1, last)
        faults[f"tkill:{turn}:in_model_call"] = _fault("in", rng.choice([1, 1, 2]))
    elif kind == "turn_kill_answer":
        faults[f"tkill:{rng.randint(1, last)}:after_model_answer"] = _fault("after")
    elif kind == "turn_kill_dispatch":
        turn = rng.randint(1, len(turns))
        nth = rng.randint(1, len(turns[turn - 1]))
        faults[f"tkill:{turn}:between_dispatches"] = _fault("after", nth=nth)
    elif kind == "turn_worker_kill":
        step = rng.randint(1, n)
        faults[f"kill:{step}"] = _fault(rng.choice(["before", "after"]), turn_worker=True)
    long = None
    if kind == "turn_long_model":
        turn = rng.randint(1, last)
        long = {"turn": turn, "seconds": round(rng.uniform(1.4, 2.0) * TURN_LEASE, 1)}
        if rng.random() < 0.5:  # the asker dies past the lease's first length, once
            faults[f"tkill:{turn}:in_long_call"] = _fault("in", 1)
        plan["enqueue_again"] = turn == 1 and rng.random() < 0.7
    if kind in TURN_KINDS and rng.random() < 0.3:  # then a later step fails for good
        j = rng.randint(2, n)
        faults[f"fail:{j}"] = _fault("before", 3)
        plan["then"] = "fail"
    return {
        "turns": turns,
        "early": early,
        "give_up": give_up,
        "think": round(rng.uniform(0.0, 0.2), 2),
        "long": long,
    }


def hosted_script(run_id: str, plan: dict[str, Any]) -> dict[str, Any]:
    """The hosted run's input: what ``chaos_app.chaos_policy`` plays, turn by turn."""
    hosted = plan["hosted"]
    calls = [[{**plan["steps"][s - 1], "step": s} for s in steps] for steps in hosted["turns"]]
    return {
        "run": run_id,
        "turns": calls,
        "early": hosted["early"],
        "give_up": hosted["give_up"],
        "think": hosted["think"],
        "long": hosted.get("long"),
    }


def make_plans(runs: int, seed: int, hosted_share: float = 0.0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [make_plan(rng, index, hosted_share) for index in range(runs)]


def digest(plans: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(plans, sort_keys=True).encode()).hexdigest()


# -- the agent --------------------------------------------------------------------------------


@dataclass
class Drive:
    """What the agent did and saw in one run."""

    index: int
    run_id: str
    plan: dict[str, Any]
    #: step -> ("ok", result) | ("failed", message) | ("in_doubt", message) | ("unsettled", why)
    seen: dict[int, tuple[str, Any]] = field(default_factory=dict)
    action: str = ""  # finished / aborted / abandoned / failed / ended
    errors: list[str] = field(default_factory=list)
    elapsed: float = 0.0


class Chaos:
    """One chaos run's processes, the agent threads and the checks."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stop = threading.Event()
        self.tmp = Path(tempfile.mkdtemp(prefix="saga-chaos-"))
        self.redis: Any = None
        #: ``--store sentinel``: the master, replica and sentinels; ``--store cluster``: the
        #: cluster's nodes, and the broker's own plain Redis beside them (with a client of it);
        #: ``--broker amqp``: the RabbitMQ node. All this run's own, disturbed by ``disturb``.
        self.sentinels: Any = None
        self.cluster: Any = None
        self.broker_redis: Any = None
        self.broker_client: Any = None
        self.rabbit: Any = None
        #: ``--broker split``: the broker is ``broker_redis``, emptied by ``disturb``.
        self.split = False
        #: What ``disturb`` did (failovers, dropped connections, node restarts), how long the
        #: longest of each kind took (a killed master's also until its replica was promoted),
        #: and what failed; the agent's retries of calls that met it.
        self.disturbed: Counter[str] = Counter()
        self.longest_disturbance = 0.0
        self.longest_of: dict[str, float] = {}
        self.fault_rng = random.Random(args.seed)
        self.cluster_faults = 0  # even: the next is a CLUSTER FAILOVER; odd: a SIGKILL
        self.disturb_failures: list[str] = []
        self.retried: Counter[str] = Counter()
        self.workers: list[Any] = []
        self.worker_logs: list[Path] = []
        self.restarts = 0
        self.restart_failures: list[str] = []
        self.longest_down = 0.0  # seconds a killed worker took to be back
        self.env: dict[str, str] = {}
        self.log_handler: logging.Handler | None = None
        self.reaped: Counter[str] = Counter()
        #: Runs the reaper had to resolve other than abandoned ones (what it did to each).
        self.reaped_runs: dict[str, list[str]] = {}
        self.lock = threading.Lock()
        self.saga: Any = None
        self.client: Any = None  # the web app's client, which enqueues hosted runs
        self.ledger: Any = None
        self.threads: list[threading.Thread] = []
        #: The turn worker's slot in ``workers`` (after the tool workers), its restarts, and
        #: the pids of the turn workers that died (a model call made in one may be repeated).
        self.turn_slot = args.workers
        self.turn_restarts = 0
        self.dead_turn_pids: set[int] = set()
        #: The operator's answers to the undos that asked, by run and step, in order (an
        #: answer is written down before it is sent: its reply may be lost to a failover).
        self.answers: dict[str, dict[int, list[str]]] = {}

    # -- processes ----------------------------------------------------------------------------

    def start(self) -> None:
        from celery import Celery

        from saga import Saga, Settings
        from saga.client import Client
        from saga.testing import RedisServer
        from tests.reliability import chaos_app

        handler = logging.FileHandler(self.tmp / "agent.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(message)s"))
        logging.getLogger().addHandler(handler)
        self.log_handler = handler
        logging.getLogger().setLevel(logging.INFO)
        if self.args.verbose:  # otherwise the saga's warnings go to the log only
            console = logging.StreamHandler()
            console.setLevel(logging.WARNING)
            logging.getLogger().addHandler(console)
        # The plain Redis: the store and the broker, or (a Sentinel or cluster store) only the
        # tools' ledger and the results, which must not go back in time with a failover.
        self.redis = RedisServer("--appendonly", "no", directory=self.tmp / "redis").start()
        plain = self.redis.url + "/0"
        url, broker = plain, plain
        topology: dict[str, str] = {}
        transport: dict[str, Any] = {}
        if self.args.store == "sentinel":
            from tests.reliability.sentinel_cluster import MASTER, SentinelCluster

            self.sentinels = SentinelCluster(self.tmp / "sentinel").start()
            url, broker = self.sentinels.url(0), self.sentinels.kombu_url(0)
            transport = {"master_name": MASTER}
            # The writes a failover must not lose wait for the replica (docs/durability.md).
            topology = {"SAGA_REDIS_CONFIRM_REPLICAS": "1", chaos_app.LEDGER_ENV: plain}
        if self.args.store == "cluster":
            import redis

            from tests.reliability.redis_cluster import RedisClusterNodes

            self.cluster = RedisClusterNodes(self.tmp / "cluster").start()
            url = self.cluster.url()
            # kombu has no cluster mode: the broker is a plain Redis of its own, never failed
            # over (the ledger's stays the tools' world alone).
            self.broker_redis = RedisServer("--appendonly", "no", directory=self.tmp / "broker")
            self.broker_redis.start()
            broker = self.broker_redis.url + "/0"
            self.broker_client = redis.Redis.from_url(broker, socket_timeout=5)
            # WAIT on the node of the run's slot (docs/durability.md): a SIGKILLed master's
            # replica then has every write the saga was told had landed.
            topology = {"SAGA_REDIS_CONFIRM_REPLICAS": "1", chaos_app.LEDGER_ENV: plain}
        results = self.redis.url + "/1"
        if self.args.broker == "amqp":
            from tests.reliability.rabbit_node import RabbitNode

            self.rabbit = RabbitNode(self.tmp / "rabbit").start()
            broker, transport = self.rabbit.url, {}
        if self.args.broker == "split":
            import redis

            # The broker and the results on a Redis of their own without persistence, killed
            # and started again empty by ``disturb``: what it held, the store sends again.
            if self.broker_redis is None:  # (a cluster store has given the broker one)
                self.broker_redis = RedisServer(
                    "--appendonly", "no", directory=self.tmp / "broker"
                ).start()
            broker, results = self.broker_redis.url + "/0", self.broker_redis.url + "/1"
            if self.broker_client is None:
                self.broker_client = redis.Redis.from_url(broker, socket_timeout=5)
            self.split = True
        database = f"sqlite:///{self.tmp / 'saga.db'}"
        self.env = {
            "SAGA_REDIS_URL": url,
            "SAGA_BROKER_URL": broker,
            "SAGA_RESULT_BACKEND": results,
            **topology,
            "SAGA_DATABASE_URL": database,
            "SAGA_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT),
            "SAGA_TASK_TIME_LIMIT": str(TIME_LIMIT),
            "SAGA_RUN_DEADLINE": str(self.args.deadline),
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
            "SAGA_CHAOS_WORKER": "1",
            "SAGA_REVERSAL_ASK_SECONDS": str(ASK_SECONDS),
        }
        self.ledger = chaos_app.configure(plain)
        app = Celery("saga-chaos-agent")
        app.config_from_object("celeryconfig")
        app.conf.update(
            broker_url=broker,
            result_backend=self.env["SAGA_RESULT_BACKEND"],
            broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT, **transport},
            task_time_limit=TIME_LIMIT,
            task_soft_time_limit=TIME_LIMIT - 1,
            broker_connection_retry_on_startup=True,
        )
        settings = Settings(
            redis_url=url,
            database_url=database,
            run_deadline_seconds=self.args.deadline,
            replicas_to_confirm=1 if self.args.store != "redis" else 0,
            reversal_ask_seconds=ASK_SECONDS,
        )
        self.saga = Saga(app, chaos_app.tools, settings)
        self.saga.records  # noqa: B018 - create the tables once, before the threads race to
        if self.args.broker == "amqp":  # the queues as the workers declare them
            from saga.celery_amqp import amqp_settings

            app.conf.update(amqp_settings(broker))
        self.client = Client(broker_url=broker, redis_url=url, settings=settings)
        self.workers = [None] * (self.args.workers + 1)
        with ThreadPoolExecutor(self.args.workers + 1) as pool:
            list(pool.map(self._start_worker, range(self.args.workers + 1)))

    def _start_worker(self, slot: int) -> None:
        """A tool worker (prefork), or in the last slot the turn worker (threads, turns only)."""
        from saga.constants import TURN_QUEUE
        from saga.testing import WorkerProcess
        from tests.reliability import chaos_app

        turns = slot == self.turn_slot
        log = self.tmp / f"{'turns' if turns else 'worker'}-{slot}-{len(self.worker_logs)}.log"
        self.worker_logs.append(log)
        if turns:
            process = WorkerProcess(
                APP,
                env=self.env,
                concurrency=self.args.turn_concurrency,
                pool="threads",
                extra_args=["-Q", TURN_QUEUE],
                cwd=ROOT,
                logfile=log,
            )
        else:
            process = WorkerProcess(
                APP, env=self.env, concurrency=self.args.concurrency, cwd=ROOT, logfile=log
            )
        self.workers[slot] = process  # before it starts, so a shutdown meanwhile stops it
        process.start(timeout=60)
        if turns:  # where a step's "kill the turn worker" aims
            self.ledger.client.set(chaos_app.TURN_WORKER, process.pid)

    def supervise(self) -> None:
        """Restart a worker that died (whole-worker kills)."""
        down: dict[int, float] = {}
        while not self.stop.wait(0.1):
            for slot, worker in enumerate(self.workers):
                if worker is not None and worker.process is not None:
                    if worker.process.poll() is None:
                        continue
                    if slot == self.turn_slot:
                        with self.lock:
                            self.dead_turn_pids.add(worker.process.pid)
                    worker.process = None
                down.setdefault(slot, time.monotonic())
                try:
                    self._start_worker(slot)
                except Exception as exc:  # try again on the next pass
                    self.restart_failures.append(f"worker {slot}: {exc}"[:300])
                    continue
                with self.lock:
                    self.restarts += 1
                    self.turn_restarts += slot == self.turn_slot
                    self.longest_down = max(self.longest_down, time.monotonic() - down[slot])
                del down[slot]

    def reap(self) -> None:
        """The reaper, as beat would run it (often, since the deadlines are short)."""
        while not self.stop.wait(self.args.reap_interval):
            try:
                report = self.saga.reap()
            except Exception as exc:
                print(f"chaos: reap failed: {exc!r}", file=sys.stderr)
                continue
            with self.lock:
                self.reaped["abandoned"] += len(report.abandoned)
                self.reaped["in_doubt"] += len(report.in_doubt)
                self.reaped["never_started"] += len(report.never_started)
                self.reaped["resent"] += len(report.resent)
                self.reaped["resumed"] += len(report.resumed)
                for run_id in report.resumed:
                    self.reaped_runs.setdefault(run_id, []).append("resumed")
                for run_id, step, verdict in report.in_doubt:
                    self.reaped_runs.setdefault(run_id, []).append(f"step {step} {verdict}")
                for run_id, step in report.never_started:
                    self.reaped_runs.setdefault(run_id, []).append(f"step {step} never started")
                for run_id, step in report.resent:
                    self.reaped_runs.setdefault(run_id, []).append(f"step {step} sent again")

    def answer_questions(self) -> None:
        """A person at the console: the undos that ask (refunds of costly charges) are
        answered as seeded for their run and step (``ANSWERS``): reversed, kept with a note,
        put off and then reversed, or never answered (the question expires)."""
        from saga.errors import OperationRefusedError, SagaError
        from saga.operations import waiting_for_a_person

        while not self.stop.wait(0.5):
            try:
                active = self.saga.store.active_runs()
            except SagaError:
                continue
            for run_id in active:
                try:
                    picture = self.saga.picture(run_id)
                except SagaError:
                    continue
                if picture is None or picture.state.value != "unwinding":
                    continue
                for question in waiting_for_a_person(picture):
                    step = int(question["step"])
                    with self.lock:
                        said = self.answers.setdefault(run_id, {}).setdefault(step, [])
                        decision = operator_answer(self.args.seed, run_id, step, said)
                        if decision == "never" and said:
                            continue
                        said.append(decision)
                    if decision == "never":
                        continue
                    note = "chaos: within the goodwill budget" if decision == "keep" else ""
                    try:
                        self.saga.decide_reversal(
                            run_id,
                            step,
                            decision,
                            args_hash=str(question["args_hash"]),
                            by="chaos-operator",
                            note=note,
                        )
                    except OperationRefusedError as exc:  # decided meanwhile (a lost reply)
                        print(f"chaos: {run_id} step {step}: {exc}", file=sys.stderr)
                    except SagaError:
                        self.note_retry("decide_reversal")

    def disturb(self) -> None:
        """The topology's own faults among the plans' kills: on a Sentinel store a
        ``SENTINEL FAILOVER`` every ``--failover-every`` seconds; on a cluster store, as often,
        a random master failed over (``cluster_fault``); on RabbitMQ, every
        ``--broker-fault-every`` seconds, every client connection dropped, or (every other
        time) the node restarted (stopped cleanly, started again on its data); on a split
        broker, as often, its Redis killed and started again empty."""
        if self.sentinels is not None or self.cluster is not None:
            every, name = self.args.failover_every, "failover"
        elif self.rabbit is not None or self.split:
            every, name = self.args.broker_fault_every, "broker"
        else:
            return
        while not self.stop.wait(every):
            try:
                if self.cluster is not None:  # each fault begins on a healthy cluster
                    self.cluster_settled()
                began = time.monotonic()
                if self.sentinels is not None:
                    self.sentinels.failover()
                    what = "failovers"
                elif self.cluster is not None:
                    what = self.cluster_fault()
                elif self.split:
                    self.broker_redis.kill()  # SIGKILL: no persistence, it comes back empty
                    self.broker_redis.start()
                    what = "broker restarts (emptied)"
                elif self.disturbed["connections dropped"] <= self.disturbed["node restarts"]:
                    self.rabbit.drop_connections()
                    what = "connections dropped"
                else:
                    self.rabbit.restart()
                    what = "node restarts"
            except Exception as exc:  # reported; the run goes on
                self.disturb_failures.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
                continue
            with self.lock:
                self.disturbed[what] += 1
                took = time.monotonic() - began
                self.longest_disturbance = max(self.longest_disturbance, took)
                self.longest_of[what] = max(self.longest_of.get(what, 0.0), took)

    def cluster_fault(self) -> str:
        """One master of the cluster, at random, failed over: in turn a ``CLUSTER FAILOVER`` on
        its replica (nothing acknowledged lost), or a SIGKILL, its replica promoted once the
        others judge it failed, and the killed node started again at once (it rejoins as the
        new master's replica: until then that slot range has no replica, so no replica
        confirmation). It returns once the cluster is healthy again (``RedisClusterNodes``
        waits for that); what it was is the count's name."""
        nodes = self.cluster
        master = self.fault_rng.choice(nodes.master_ports())
        if self.cluster_faults % 2 == 0:
            self.cluster_faults += 1
            nodes.failover(master, timeout=60)
            return "cluster failovers"
        self.cluster_faults += 1
        began = time.monotonic()
        try:
            nodes.kill_master(master, timeout=60)
            promoted = time.monotonic() - began
            with self.lock:
                longest = self.longest_of.get(PROMOTED, 0.0)
                self.longest_of[PROMOTED] = max(longest, promoted)
        finally:
            if nodes.server(master).process is None:  # whatever the wait said: back at once
                nodes.restart(master, timeout=60)
        return "masters killed"

    def cluster_settled(self) -> None:
        """Wait (60 s at most) for every slot to be served and every replica to be linked to
        its master: no fault starts on a cluster still recovering from the last."""
        from tests.reliability.sentinel_cluster import wait_until

        wait_until(self.cluster._healthy, 60, "the cluster to be healthy before the next fault")

    def start_threads(self) -> None:
        self.threads = [
            threading.Thread(target=self.supervise, daemon=True, name="supervisor"),
            threading.Thread(target=self.reap, daemon=True, name="reaper"),
            threading.Thread(target=self.disturb, daemon=True, name="disturber"),
            threading.Thread(target=self.answer_questions, daemon=True, name="operator"),
        ]
        for thread in self.threads:
            thread.start()

    def stop_threads(self) -> None:
        """Stop the supervisor and the reaper; no worker is (re)started after this."""
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=90)

    def shutdown(self) -> None:
        self.stop_threads()
        for worker in self.workers:
            if worker is not None:
                worker.stop(timeout=15)
        if self.client is not None:
            self.client.store.client.close()
        if self.saga is not None:
            self.saga.store.client.close()
            if self.saga.core._records is not None:
                self.saga.records.dispose()
        if self.ledger is not None:
            self.ledger.client.close()
        if self.redis is not None:
            self.redis.stop()
        if self.sentinels is not None:
            self.sentinels.stop()
        if self.cluster is not None:
            self.cluster.stop()
        if self.broker_client is not None:
            self.broker_client.close()
        if self.broker_redis is not None:
            self.broker_redis.stop()
        if self.rabbit is not None:
            self.rabbit.stop()
        if self.log_handler is not None:
            logging.getLogger().removeHandler(self.log_handler)
            self.log_handler.close()
        if self.args.keep:
            print(f"chaos: kept {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- the agent ----------------------------------------------------------------------------

    def note_retry(self, what: str) -> None:
        with self.lock:
            self.retried[what] += 1

    def start_run(self, run_id: str, deadline: float) -> Any:
        """``start_run``, again through a failover; a run that exists after an unanswered
        try is this one (its creation reached the store)."""
        from saga.errors import RunExistsError, StoreUnavailableError

        options = {"peek": "unwind"}
        # The plans were written for driven runs where any final failure unwinds: the read's
        # too, which a driven run would otherwise feed back.
        unanswered = False
        while True:
            try:
                return self.saga.start_run(run_id, deadline=deadline, on_failure=options)
            except RunExistsError:
                if not unanswered:
                    raise
                return self.patient(self.saga.run, run_id, options)
            except StoreUnavailableError:
                unanswered = True
                self.note_retry("start_run")
                if self.stop.wait(0.2):
                    raise

    def call(self, run: Any, number: int, step: dict[str, Any]) -> Any:
        """``run.call``; when the store did not answer, the run's own record says whether
        the step was reserved (it is then that step) or not (call again)."""
        from saga.errors import DispatchError, StoreUnavailableError
        from saga.model import StepState
        from saga.runs import StepHandle

        deadline = time.monotonic() + self.args.step_timeout
        while True:
            try:
                return run.call(step["tool"], **step["args"])
            except StoreUnavailableError:
                if time.monotonic() > deadline or self.stop.is_set():
                    raise
                self.note_retry("call")
                time.sleep(0.2)
                steps = {s.step: s for s in self.patient(run.picture).steps}
                if number in steps:
                    if steps[number].state is StepState.NOT_DISPATCHED:  # released, not sent
                        raise DispatchError(f"step {number} released, the store away") from None
                    return StepHandle(run.core, run.run_id, number, step["tool"])

    def finish(self, run: Any) -> None:
        """``run.finish``; after an unanswered try, a run found completed was finished."""
        from saga.errors import RunEndedError, StoreUnavailableError
        from saga.model import RunState

        unanswered = False
        while True:
            try:
                run.finish(timeout=self.args.step_timeout)
                return
            except RunEndedError:
                if unanswered and self.patient(run.state) is RunState.COMPLETED:
                    return
                raise
            except StoreUnavailableError:
                unanswered = True
                self.note_retry("finish")
                if self.stop.wait(0.2):
                    raise

    def drive(self, index: int, plan: dict[str, Any]) -> Drive:
        from saga.errors import DispatchError, RunEndedError, StepsInFlightError

        run_id = f"s{self.args.seed}r{index:04d}"
        drive = Drive(index, run_id, plan)
        started = time.monotonic()
        if "hosted" in plan:
            return self.drive_hosted(drive, started)
        try:
            if plan["faults"]:
                from tests.reliability.chaos_app import plan_key

                faults = {k: json.dumps(v) for k, v in plan["faults"].items()}
                self.ledger.client.hset(plan_key(run_id), mapping=faults)
            deadline = self.args.deadline if plan["deadline"] == "long" else SHORT_DEADLINE
            run = self.start_run(run_id, deadline)
            agent = plan["agent"]
            for number, step in enumerate(plan["steps"], 1):
                if agent.get("abandon_after") == number - 1:
                    drive.action = "abandoned"
                    return drive
                if agent.get("abort_after") == number - 1:
                    drive.action = "aborted"
                    with contextlib.suppress(RunEndedError):
                        self.patient(run.abort, "the agent changed its mind")
                    break
                try:
                    handle = self.call(run, number, step)
                except RunEndedError:
                    drive.action = "ended"
                    break
                except DispatchError as refused:  # the broker away: give the run up
                    drive.action = "dispatch refused"
                    self.note_retry("dispatch refused: run aborted")
                    with contextlib.suppress(RunEndedError):
                        self.patient(run.abort, f"the agent could not call: {refused}"[:200])
                    break
                if handle.step != number:
                    drive.errors.append(
                        f"step {step['tool']} got number {handle.step}, not {number}"
                    )
                outcome = self._settle(handle, run)
                drive.seen[number] = outcome
                if outcome[0] != "ok":
                    drive.action = "failed"
                    break
            else:
                if agent.get("abort_after") == len(plan["steps"]):
                    drive.action = "aborted"
                    with contextlib.suppress(RunEndedError):
                        self.patient(run.abort, "the agent changed its mind")
                else:
                    try:
                        self.finish(run)
                        drive.action = "finished"
                        return drive
                    except (RunEndedError, StepsInFlightError) as exc:
                        drive.action = f"finish refused: {type(exc).__name__}"
            self._wait_end(run)
        except Exception as exc:
            drive.errors.append(f"agent: {type(exc).__name__}: {exc}")
            if self.args.verbose:
                traceback.print_exc()
        finally:
            drive.elapsed = time.monotonic() - started
        return drive

    def drive_hosted(self, drive: Drive, started: float) -> Drive:
        """Enqueue a hosted run (as a web app would) and wait for its end; then read what each
        step told the model from its record."""
        from saga.model import StepState
        from tests.reliability.chaos_app import plan_key

        plan, run_id = drive.plan, drive.run_id
        try:
            if plan["faults"]:
                faults = {k: json.dumps(v) for k, v in plan["faults"].items()}
                self.ledger.client.hset(plan_key(run_id), mapping=faults)
            deadline = HOSTED_DEADLINE if plan["deadline"] == "long" else SHORT_DEADLINE
            script = json.dumps(hosted_script(run_id, plan))
            if self.enqueue(script, run_id, deadline) != run_id:
                drive.errors.append("enqueue_run returned another run id")
            drive.action = "enqueued"
            if plan.get("enqueue_again"):
                # A web app retrying its request while turn 1's long model call runs, past
                # the lease's first length: the repeat must not ask the model a second time.
                self.stop.wait(TURN_LEASE + 1.0)
                if self.enqueue(script, run_id, deadline) != run_id:
                    drive.errors.append("enqueue_run again returned another run id")
            limit = time.monotonic() + 2 * self.args.step_timeout
            while not self.stop.is_set() and time.monotonic() < limit:
                if self.patient(self.saga.picture, run_id).state.ended:
                    drive.action = "ended"
                    break
                time.sleep(0.1)
            for step in self.patient(self.saga.picture, run_id).steps:
                if step.state is StepState.SUCCEEDED:
                    drive.seen[step.step] = ("ok", step.result)
                elif step.state in (StepState.FAILED, StepState.REJECTED):
                    drive.seen[step.step] = ("failed", (step.error or {}).get("message", ""))
                elif step.state is StepState.IN_DOUBT:
                    drive.seen[step.step] = ("in_doubt", "")
        except Exception as exc:
            drive.errors.append(f"agent: {type(exc).__name__}: {exc}")
            if self.args.verbose:
                traceback.print_exc()
        finally:
            drive.elapsed = time.monotonic() - started
        return drive

    def enqueue(self, script: str, run_id: str, deadline: float) -> str:
        """``enqueue_run`` as a web app would: called again with the same id while the store
        or the broker is away (``MessageNotSentError`` says the run exists, its turn unsent)."""
        from saga.errors import MessageNotSentError, StoreUnavailableError
        from tests.reliability.chaos_app import AGENT

        limit = time.monotonic() + self.args.step_timeout
        while True:
            try:
                return str(self.client.enqueue_run(AGENT, script, run_id=run_id, deadline=deadline))
            except (StoreUnavailableError, MessageNotSentError) as exc:
                if time.monotonic() > limit or self.stop.is_set():
                    raise
                self.note_retry(f"enqueue_run ({type(exc).__name__})")
                time.sleep(0.5)

    def _settle(self, handle: Any, run: Any) -> tuple[str, Any]:
        """Wait for a step's outcome; give up if its run ended without one (or time runs out)."""
        from saga.errors import (
            StepFailedError,
            StepInDoubtError,
            StepSkippedError,
            StoreUnavailableError,
            WaitTimeoutError,
        )

        deadline = time.monotonic() + self.args.step_timeout
        while not self.stop.is_set():
            try:
                return ("ok", handle.result(timeout=1.0))
            except (StepFailedError, StepSkippedError) as exc:
                return ("failed", str(exc))
            except StepInDoubtError as exc:  # the run is failing; it reconciles the step
                return ("in_doubt", str(exc))
            except StoreUnavailableError:
                self.note_retry("result")
                time.sleep(0.2)
                continue
            except WaitTimeoutError:
                state = self.patient(run.state)
                if state.ended:
                    return ("unsettled", f"run {state.value}, step {handle.state().value}")
                if time.monotonic() > deadline:
                    return ("unsettled", f"no outcome in {self.args.step_timeout}s")
        return ("unsettled", "stopped")

    def _wait_end(self, run: Any) -> None:
        deadline = time.monotonic() + self.args.step_timeout
        while not self.stop.is_set() and time.monotonic() < deadline:
            if self.patient(run.state).ended:
                return
            time.sleep(0.05)

    def wait_all_ended(self, run_ids: list[str], timeout: float) -> list[str]:
        """Wait (bounded) until no run is running or unwinding and the broker has delivered
        every message, stranded ones included (they may still act on a run that ended)."""
        deadline = time.monotonic() + timeout
        quiet_since = None
        while True:
            open_runs = [r for r in run_ids if not self.patient(self.saga.picture, r).state.ended]
            if open_runs or self._broker_busy():
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            if quiet_since is not None and time.monotonic() - quiet_since > self._quiet_for():
                return []
            if time.monotonic() > deadline or self.stop.is_set():
                return open_runs
            time.sleep(0.25)

    def _quiet_for(self) -> float:
        """How long the broker must look idle: RabbitMQ's queue lengths lag behind."""
        from tests.reliability.rabbit_node import STATISTICS_LAG

        return 1.0 + (STATISTICS_LAG if self.rabbit is not None else 0.0)

    def patient(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        """``call`` (a read, or a write safe to repeat), again while the store is failing over
        (``StoreUnavailableError``), as a caller that knows the error is retryable would."""
        from saga.errors import StoreUnavailableError

        deadline = time.monotonic() + self.args.step_timeout
        while True:
            try:
                return call(*args, **kwargs)
            except StoreUnavailableError:
                if time.monotonic() > deadline or self.stop.is_set():
                    raise
                with self.lock:
                    self.retried[getattr(call, "__name__", "call")] += 1
                time.sleep(0.2)

    def _broker_busy(self) -> bool:
        """Messages queued, or delivered and not yet acknowledged (kombu's Redis keys, on the
        store's Redis or the broker's own; on RabbitMQ, its queues' lengths, unacknowledged
        included)."""
        import redis

        from saga.constants import TURN_QUEUE
        from saga.errors import StoreUnavailableError

        try:
            if self.rabbit is not None:
                return bool(self.rabbit.messages())
            client = self.broker_client or self.saga.store.client
            return bool(client.llen("celery") or client.llen(TURN_QUEUE) or client.hlen("unacked"))
        except (redis.RedisError, StoreUnavailableError, RuntimeError, OSError):
            return True  # a failover or a restart: not quiet


# -- checks -----------------------------------------------------------------------------------


@dataclass
class Findings:
    violations: list[str] = field(default_factory=list)
    notes: Counter[str] = field(default_factory=Counter)
    note_examples: dict[str, str] = field(default_factory=dict)
    states: Counter[str] = field(default_factory=Counter)

    def violation(self, drive: Drive, message: str) -> None:
        self.violations.append(f"{drive.run_id} [{drive.plan['kind']}]: {message}")

    def note(self, drive: Drive, what: str, detail: str) -> None:
        self.notes[what] += 1
        self.note_examples.setdefault(what, f"{drive.run_id} [{drive.plan['kind']}]: {detail}")


def check(
    saga: Any,
    ledger: Any,
    drives: list[Drive],
    dead_turn_pids: set[int] | None = None,
    answers: dict[str, dict[int, list[str]]] | None = None,
) -> tuple[Findings, dict[str, Any]]:
    """Every invariant, from the ledger; the saga's records are only read to see what a person
    would be told (escalations) and how each run ended. ``dead_turn_pids``: the turn workers
    that died (killed) during the run; ``answers``: what the operator answered to the undos
    that asked (``Chaos.answer_questions``)."""
    from saga.model import CompensationState
    from tests.reliability import chaos_app

    client = ledger.client
    applied = {k: json.loads(v) for k, v in client.hgetall(chaos_app.APPLIED).items()}
    executions = {k: int(v) for k, v in client.hgetall(chaos_app.EXECUTIONS).items()}
    anomalies = client.lrange(chaos_app.ANOMALIES, 0, -1)
    escalations: dict[str, list[Any]] = {}
    for record in saga.records.escalations():
        escalations.setdefault(record.run_id, []).append(record)
    findings = Findings()
    for anomaly in anomalies:
        findings.violations.append(f"ledger anomaly: {anomaly}")
    by_run: dict[str, dict[str, dict[str, Any]]] = {}
    for key, record in applied.items():
        by_run.setdefault(record["run"], {})[key] = record
    hosted: Counter[str] = Counter()
    for drive in drives:
        said = (answers or {}).get(drive.run_id, {})
        _check_run(saga, drive, by_run.get(drive.run_id, {}), escalations, findings, said)
        if "hosted" in drive.plan:
            _check_hosted(saga, drive, dead_turn_pids or set(), findings, hosted)
        for error in drive.errors:
            findings.violation(drive, error)
    comps: Counter[str] = Counter()
    reconciled: Counter[str] = Counter()
    for drive in drives:
        picture = saga.picture(drive.run_id)
        comps.update(c.state.value for c in picture.compensations)
        reconciled.update(s.reconciled for s in picture.steps if s.reconciled)
    figures: dict[str, Any] = {
        "applications": len(applied),
        "undo_applications": sum(1 for r in applied.values() if r["undo"]),
        "redelivered": sum(n - 1 for n in executions.values() if n > 1),
        "escalation_records": sum(len(v) for v in escalations.values()),
        "compensations_done": comps[CompensationState.DONE.value],
        "compensations_failed": comps[CompensationState.FAILED.value],
        "reconciled": reconciled,
        "hosted": dict(hosted),
        "questions": sum(len(steps) for steps in (answers or {}).values()),
        "answered": Counter(
            said[0] for steps in (answers or {}).values() for said in steps.values()
        ),
        "compensations_kept": comps[CompensationState.KEPT.value],
    }
    return findings, figures


def _check_hosted(
    saga: Any, drive: Drive, dead: set[int], findings: Findings, figures: Counter[str]
) -> None:
    """A hosted run's turns, against the policy's own count of its calls (``chaos_app``):

    - each turn whose answer was recorded was asked exactly once, plus once for every earlier
      call made in a turn worker that was killed before the answer was kept (the plan's kills
      inside the model call, or a kill of the whole turn worker meant for another run): the
      recorded answer is the last call's, and every call before it was made by a dead pid;
    - a turn asked without a recorded answer is the one the model gave up at, or one whose
      every asker died (the run then ended without it);
    - each answer is the script's; each call in it got at most one step, the step its place
      in the script says, except the irreversible call asked for too early, which got none and
      was refused; in a completed run every call was refused or dispatched;
    - the loop's own counters agree with the policy's: ``<k>:asked`` and ``model_calls``
      count the same calls (more only where a turn worker died between the loop counting a
      call and the policy being called), and the SQL transcript holds the recorded turns.
    """
    from saga.agents.turn_state import LoopState
    from saga.model import RunState
    from tests.reliability import chaos_app

    plan, run_id = drive.plan, drive.run_id
    picture = saga.picture(run_id)
    state = LoopState.parse(picture.agent)
    if state is None:
        findings.violation(drive, "hosted run without its loop's state")
        return
    script = chaos_app.script_turns(hosted_script(run_id, plan))
    client = chaos_app.ledger().client
    last_turn = len(script) + 1
    calls: dict[int, int] = {}
    askers: dict[int, list[tuple[int, int]]] = {}
    for k in range(1, last_turn + 2):
        count = int(client.get(chaos_app.model_calls_key(run_id, k)) or 0)
        log = [e.split() for e in client.lrange(chaos_app.model_log_key(run_id, k), 0, -1)]
        if count:
            calls[k] = count
            askers[k] = [(int(pid), int(asked)) for pid, asked in log]
        if count != len(log):
            findings.violation(drive, f"turn {k}: {count} model calls counted, {len(log)} logged")
    gave_up = {int(k): why for k, why in client.hgetall(chaos_app.gave_up_key(run_id)).items()}
    figures["runs"] += 1
    figures["turns"] += len(state.answers)
    figures["model_calls"] += sum(calls.values())
    # 1. At most one model call per turn whose answer was recorded (kills accounted for).
    answered = sorted(state.answers)
    if answered != list(range(1, len(answered) + 1)):
        findings.violation(drive, f"answers recorded for turns {answered}")
    for k in sorted(set(calls) | set(answered)):
        count, log = calls.get(k, 0), askers.get(k, [])
        answer = state.answers.get(k)
        if answer is not None:
            won = int(answer.raw.get("call", 0))
            if count == 0:
                findings.violation(drive, f"turn {k}: an answer recorded, no model call counted")
            elif won != count:
                findings.violation(
                    drive,
                    f"turn {k}: the model was asked {count} times, the answer recorded is call "
                    f"{won}'s (asked again after it was recorded)",
                )
            earlier = log[: max(won - 1, 0)]
        else:
            ended_here = k == len(answered) + 1
            if not ended_here:
                findings.violation(drive, f"turn {k} asked, no answer, turns after it asked")
            earlier = log if k not in gave_up else log[:-1]
            if k in gave_up and not ended_here:
                findings.violation(drive, f"the model gave up at turn {k}, yet the run went on")
        alive = [pid for pid, _ in earlier if pid not in dead]
        if alive:
            findings.violation(
                drive,
                f"turn {k}: the model was asked {count} times; the earlier call(s) were made by "
                f"turn worker(s) {alive}, which did not die: a second model call",
            )
        figures["repeated_after_kill"] += len(earlier)
        # The loop's own count: one per policy call, plus any delivery that died in between.
        asked = state.asked.get(k, 0)
        if asked < count:
            findings.violation(
                drive, f"turn {k}: the loop counted {asked} asks, the policy {count}"
            )
        elif asked > count:
            findings.note(drive, "ask counted, asker died first", f"turn {k}: {asked} vs {count}")
        seen_asked = [a for _, a in log]
        if seen_asked != sorted(set(seen_asked)):
            findings.violation(drive, f"turn {k}: the loop's ask counts seen {seen_asked}")
    if state.model_calls != sum(state.asked.values()):
        findings.violation(
            drive, f"model_calls {state.model_calls}, asks per turn {dict(state.asked)}"
        )
    # 2. Each answer is the script's; each call got at most one step, the one it should.
    per_call = Counter(s.call for s in picture.steps if s.call)
    for marker, count in sorted(per_call.items()):
        if count > 1:
            findings.violation(drive, f"call {marker} dispatched {count} times")
    for s in picture.steps:
        if not s.call:
            findings.violation(drive, f"step {s.step} ({s.tool}) has no call marker")
    steps = {s.call: s for s in picture.steps if s.call}
    for k, answer in sorted(state.answers.items()):
        wanted = script[k - 1] if k <= len(script) else []
        got = [(c.name, c.arguments) for c in answer.calls]
        if got != [(c["tool"], c["args"]) for c in wanted]:
            findings.violation(drive, f"turn {k}: answer {got}, the script says {wanted}")
            continue
        for i, call in enumerate(wanted):
            step = steps.get(f"{k}:{i}")
            refused = (k, i) in state.refused
            if call["step"] is None:
                figures["early_refused"] += refused
                if step is not None:
                    findings.violation(drive, f"early {call['tool']} (call {k}:{i}) dispatched")
                elif not refused and picture.state is RunState.COMPLETED:
                    findings.violation(drive, f"early {call['tool']} (call {k}:{i}) not refused")
            elif step is not None and step.step != call["step"]:
                findings.violation(drive, f"call {k}:{i} is step {step.step}, not {call['step']}")
            elif step is None and picture.state is RunState.COMPLETED:
                findings.violation(drive, f"call {k}:{i} ({call['tool']}) skipped, run completed")
    # 3. How it ended agrees with the script.
    if picture.state is RunState.COMPLETED:
        if answered != list(range(1, last_turn + 1)) or state.answers[last_turn].calls:
            findings.violation(drive, f"completed after turns {answered} of {last_turn}")
        if gave_up:
            findings.violation(drive, f"completed, yet the model gave up ({gave_up})")
    record = saga.records.transcript(run_id)
    if record is None:
        findings.violation(drive, "no transcript record")
    else:
        turns = record.transcript.get("turns", [])
        if [t["turn"] for t in turns] != answered or record.model_calls != state.model_calls:
            findings.violation(
                drive,
                f"transcript record: turns {[t['turn'] for t in turns]}, model calls "
                f"{record.model_calls}; the loop: turns {answered}, {state.model_calls} calls",
            )


def _check_run(
    saga: Any,
    drive: Drive,
    effects: dict[str, dict[str, Any]],
    escalations: dict[str, list[Any]],
    findings: Findings,
    said: dict[int, list[str]] | None = None,
) -> None:
    from saga.model import CompensationState, RunState

    plan, run_id = drive.plan, drive.run_id
    picture = saga.picture(run_id)
    said = said or {}
    # 0. An effect is kept on purpose only where a person said keep; an undo still asking
    # in an ended run was neither answered nor expired.
    kept = {c.step for c in picture.compensations if c.state is CompensationState.KEPT}
    for step in sorted(kept):
        if "keep" not in said.get(step, []):
            findings.violation(drive, f"step {step} kept, nobody answered keep ({said.get(step)})")
    for comp in picture.compensations:
        if comp.state is CompensationState.ASKED and picture.state.ended:
            findings.violation(drive, f"run {picture.state.value}, step {comp.step} still asks")
    state = picture.state
    findings.states[state.value] += 1
    # 1. Exactly one end, recorded for people, none stuck.
    if not state.ended:
        findings.violation(drive, f"stuck {state.value} ({picture.reason})")
        return
    record = saga.records.run(run_id)
    if record is None:
        findings.violation(drive, f"ended {state.value} but no run record")
    elif record.state != state.value:
        findings.violation(drive, f"run record says {record.state}, the run is {state.value}")
    records = [e for e in escalations.get(run_id, []) if not e.resolved]
    if state is RunState.ESCALATED and not records and not (kept and escalations.get(run_id)):
        findings.violation(drive, f"escalated ({picture.reason}) without an escalation record")
    if state is not RunState.ESCALATED and records:
        findings.violation(drive, f"{state.value} but has an open escalation record")
    listed_live = {int(item["step"]) for e in records for item in e.not_undone}
    listed_failed = {int(item["step"]) for e in records for item in e.failed_compensations}

    forward: dict[int, dict[str, Any]] = {r["step"]: r for r in effects.values() if not r["undo"]}
    undone: dict[int, dict[str, Any]] = {r["step"]: r for r in effects.values() if r["undo"]}
    # 2. Once each: an effect applied under two keys is an effect applied twice.
    counts = Counter((r["step"], r["undo"]) for r in effects.values())
    for (step, undo), count in sorted(counts.items()):
        if count > 1:
            what = "undone" if undo else "applied"
            findings.violation(drive, f"step {step} {what} {count} times (under distinct keys)")
    tools = {n: s["tool"] for n, s in enumerate(plan["steps"], 1)}
    # 3. Undos: only of what happened, after it happened, most recent first.
    for step, undo in undone.items():
        if step not in forward:
            findings.violation(drive, f"undo of step {step} applied, its effect never was")
        elif undo["seq"] < forward[step]["seq"]:
            findings.violation(drive, f"undo of step {step} applied before the step itself")
        elif tools.get(step) not in COMPENSATABLE:
            findings.violation(drive, f"step {step} ({tools.get(step)}) has no undo, one ran")
    order = [r["step"] for r in sorted(undone.values(), key=lambda r: r["seq"])]
    if order != sorted(order, reverse=True):
        findings.violation(drive, f"undos out of reverse order: steps {order}")
    # 4. Each effect: kept or undone exactly once, as the run's end says.
    for step, effect in sorted(forward.items()):
        tool = effect["tool"]
        if tool in COMPENSATABLE:
            if state is RunState.COMPLETED and step in undone:
                findings.violation(drive, f"step {step} ({tool}) undone in a completed run")
            elif state is RunState.COMPENSATED and step not in undone:
                findings.violation(drive, f"step {step} ({tool}) live in a compensated run")
            elif state is RunState.ESCALATED and step not in undone:
                if step not in listed_live and step not in kept:
                    findings.violation(
                        drive, f"step {step} ({tool}) live, escalated without listing it"
                    )
            elif state is RunState.ESCALATED and step in listed_live:
                findings.note(drive, "undone, but listed live", f"step {step} ({tool})")
        elif tool == "notify":
            if state is RunState.COMPENSATED:
                findings.violation(drive, f"step {step} (notify) sent in a compensated run")
            elif state is RunState.ESCALATED and step not in listed_live:
                findings.violation(drive, f"step {step} (notify) sent, escalation omits it")
        elif tool == "tag" and state is RunState.ESCALATED and step not in listed_live:
            findings.note(drive, "convergent write kept, not listed", f"step {step}")
    # 5. What the agent was told matches the world.
    for step, (status, value) in drive.seen.items():
        tool = tools.get(step)
        if tool is None:
            findings.violation(drive, f"step {step} ran, the plan has {len(tools)} steps")
            continue
        if status != "ok" or tool not in WRITES:
            continue
        found = forward.get(step)
        if found is None:
            findings.violation(drive, f"step {step} ({tool}) reported success, no effect exists")
        elif found["result"] != value:
            findings.violation(
                drive, f"step {step} ({tool}) reported {value}, the effect is {found['result']}"
            )
    # 6. Failed compensations are in front of a person; failures are never completions.
    for comp in picture.compensations:
        if comp.state is CompensationState.FAILED and comp.step not in listed_failed:
            findings.violation(drive, f"compensation of step {comp.step} failed, not escalated")
        if comp.state is not CompensationState.DONE and state is RunState.COMPENSATED:
            findings.violation(drive, f"compensated with step {comp.step}'s undo {comp.state}")
    failed_for_good = [
        name
        for name, spec in plan["faults"].items()
        if name.startswith("fail:") and (spec.get("final") or spec["times"] >= 3)
    ]
    reached = {int(name.split(":")[1]) for name in failed_for_good} & set(drive.seen)
    # A delivery that failed and then died (another run's whole-worker kill) before recording
    # the failure is redelivered, and a failover can lose a retry's count: past the plan's
    # injected failures, the step may rightly succeed. Such a step reached its fault point more
    # often than the plan has failures for it (the tools' own count, which no failover loses).
    from tests.reliability import chaos_app

    fired = chaos_app.ledger().client.hgetall(chaos_app.fired_key(run_id))
    steps = {s.step: s for s in picture.steps}
    reached = {
        step
        for step in reached
        if max(int(fired.get(f"fail:{step}", 0)), steps[step].attempts if step in steps else 0)
        <= plan["faults"][f"fail:{step}"]["times"]
    }
    if reached and state is RunState.COMPLETED:
        findings.violation(drive, f"step(s) {sorted(reached)} failed for good, run completed")
    for step in reached:
        if drive.seen[step][0] == "ok":
            findings.violation(drive, f"step {step} was made to fail, the agent saw success")
        if plan["faults"][f"fail:{step}"]["point"] == "before" and step in forward:
            findings.violation(drive, f"step {step} failed before its effect, yet it exists")
    # 7. The world itself: a compensated run leaves its slots and accounts as they were.
    _check_world(saga, drive, forward, undone, state, findings)
    if plan["kind"] in RECOVERABLE and not plan["then"] and state is not RunState.COMPLETED:
        findings.note(drive, "recoverable faults, run not completed", picture.reason)
    if any(s.state.value == "in_doubt" for s in picture.steps):
        findings.note(drive, "step left in doubt", picture.doubt or picture.reason)


def _check_world(
    saga: Any,
    drive: Drive,
    forward: dict[int, dict[str, Any]],
    undone: dict[int, dict[str, Any]],
    state: Any,
    findings: Findings,
) -> None:
    from saga.model import RunState
    from tests.reliability import chaos_app

    client = chaos_app.ledger().client
    puts = [(n, r) for n, r in sorted(forward.items()) if r["tool"] == "put"]
    charges = [(n, r) for n, r in sorted(forward.items()) if r["tool"] == "charge"]
    slots = sorted({int(r["args"]["slot"]) for _, r in puts})
    accounts = sorted({r["args"]["account"] for _, r in charges})
    for account in accounts:
        balance = int(client.get(chaos_app.balance_key(account)) or 0)
        kept = sum(int(r["args"]["cents"]) for n, r in charges if r["args"]["account"] == account)
        refunded = sum(
            int(r["args"]["cents"])
            for n, r in charges
            if r["args"]["account"] == account and n in undone
        )
        if balance != kept - refunded:
            findings.violation(
                drive,
                f"account {account} holds {balance}, charges minus refunds: {kept - refunded}",
            )
    if state is not RunState.COMPLETED:
        for slot in slots:
            value = client.get(chaos_app.slot_key(slot)) or ""
            on_slot = [n for n, r in puts if int(r["args"]["slot"]) == slot]
            if value != "" and all(n in undone for n in on_slot):
                findings.violation(
                    drive, f"slot {slot} is {value!r} after every put on it was undone, not ''"
                )
            elif value != "" and state is RunState.COMPENSATED:
                findings.violation(drive, f"slot {slot} is {value!r} after compensation, not ''")
    else:
        for slot in slots:
            value = client.get(chaos_app.slot_key(slot)) or ""
            last = [r["args"]["value"] for _, r in puts if int(r["args"]["slot"]) == slot][-1]
            if value != last:
                findings.violation(drive, f"slot {slot} is {value!r}, last put was {last!r}")


# -- main -------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.reliability.chaos", description=__doc__)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2, help="pool processes per worker")
    parser.add_argument(
        "--hosted-share", type=float, default=0.25, help="share of the runs that are hosted"
    )
    parser.add_argument("--turn-concurrency", type=int, default=20, help="turn worker threads")
    parser.add_argument("--parallel", type=int, default=8, help="runs driven at a time")
    parser.add_argument(
        "--deadline", type=int, default=LONG_DEADLINE, help="most runs' deadline (s), for reaping"
    )
    parser.add_argument("--reap-interval", type=float, default=1.0)
    parser.add_argument("--step-timeout", type=float, default=60.0)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--keep", action="store_true", help="keep the worker logs and database")
    parser.add_argument(
        "--plans-only", action="store_true", help="print the plans' digest (-v: the plans), stop"
    )
    parser.add_argument(
        "--only",
        type=lambda text: [int(i) for i in text.split(",")],
        help="drive only these runs of the seed's plans (indexes, as in s<seed>r<index>)",
    )
    parser.add_argument(
        "--store",
        choices=["redis", "sentinel", "cluster"],
        default="redis",
        help="the store: one Redis, a master, a replica and three sentinels, or a Redis Cluster "
        "of three masters with a replica each (failed over)",
    )
    parser.add_argument(
        "--broker",
        choices=["redis", "amqp", "split"],
        default="redis",
        help="the broker: the store's Redis, a RabbitMQ node of the run's own (disturbed), or "
        "a Redis of its own without persistence (killed and started again empty)",
    )
    parser.add_argument(
        "--failover-every",
        type=float,
        default=20.0,
        help="seconds between store failovers (Sentinel's; a cluster master's: CLUSTER FAILOVER "
        "and SIGKILL in turn)",
    )
    parser.add_argument(
        "--broker-fault-every",
        type=float,
        default=25.0,
        help="seconds between broker faults (RabbitMQ: connections dropped, node restarted, "
        "in turn; split: its Redis killed and started again empty)",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from tests.reliability import chaos_app

    args = parse(argv)
    plans = make_plans(args.runs, args.seed, args.hosted_share)
    kinds = Counter(p["kind"] for p in plans)
    print(f"chaos: seed {args.seed}, {args.runs} runs, plans sha256 {digest(plans)[:16]}")
    thens = Counter(p["kind"] for p in plans if p["then"])
    print(
        "plans: "
        + ", ".join(
            f"{k} {kinds[k]}" + (f" ({thens[k]} then fail)" if thens[k] else "")
            for k in dict([*KINDS, *HOSTED_KINDS])
            if kinds[k]
        )
    )
    hosted_kinds = Counter(p["kind"] for p in plans if "hosted" in p)
    print(
        f"hosted: {sum(hosted_kinds.values())} runs ("
        + ", ".join(f"{k} {hosted_kinds[k]}" for k, _ in HOSTED_KINDS if hosted_kinds[k])
        + ")"
    )
    if args.plans_only:
        if args.verbose:
            for index, plan in enumerate(plans):
                print(f"s{args.seed}r{index:04d} {json.dumps(plan)}")
        return 0
    chaos = Chaos(args)
    started = time.monotonic()
    drives: list[Drive] = []
    try:
        chaos.start()
        where = f"redis {chaos.redis.port}"
        if chaos.sentinels is not None:
            master, replica = chaos.sentinels.ports
            where = (
                f"store on Sentinel (master {master}, replica {replica}, sentinels "
                f"{','.join(map(str, chaos.sentinels.sentinel_ports))}; failover every "
                f"{args.failover_every:g}s), ledger on redis {chaos.redis.port}"
            )
        if chaos.cluster is not None:
            masters = chaos.cluster.master_ports()
            replicas = sorted(set(chaos.cluster.ports) - set(masters))
            where = (
                f"store on a Redis Cluster (masters {','.join(map(str, masters))}, replicas "
                f"{','.join(map(str, replicas))}; a master failed over every "
                f"{args.failover_every:g}s, CLUSTER FAILOVER and SIGKILL in turn)"
                + (f", broker on redis {chaos.broker_redis.port}" if chaos.broker_redis else "")
                + f", ledger and results on redis {chaos.redis.port}"
            )
        if chaos.split:
            where += (
                f", broker and results on redis {chaos.broker_redis.port} without persistence "
                f"(killed and started again empty every {args.broker_fault_every:g}s)"
            )
        if chaos.rabbit is not None:
            where += (
                f", broker RabbitMQ node {chaos.rabbit.name} on {chaos.rabbit.port} (a fault "
                f"every {args.broker_fault_every:g}s)"
            )
        print(
            f"started: {where}, {args.workers} workers x {args.concurrency}"
            f" and a turn worker x {args.turn_concurrency}, {time.monotonic() - started:.1f}s"
        )
        chaos.start_threads()
        pool = ThreadPoolExecutor(args.parallel, thread_name_prefix="agent")
        try:
            indexes = args.only if args.only is not None else range(args.runs)
            drives = list(pool.map(chaos.drive, indexes, [plans[i] for i in indexes]))
        except BaseException:
            chaos.stop.set()  # the agents give up at once, so the pool can shut down
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        driven = time.monotonic() - started
        run_ids = [d.run_id for d in drives]
        longest = max(args.deadline, HOSTED_DEADLINE if args.hosted_share > 0 else 0)
        stuck = chaos.wait_all_ended(run_ids, timeout=60 + VISIBILITY_TIMEOUT + 2 * longest)
        settled = time.monotonic() - started
        chaos.stop_threads()
        for worker in chaos.workers:  # nothing may move while the ledger is read
            if worker is not None:
                worker.stop(timeout=15)
        findings, figures = check(
            chaos.saga, chaos.ledger, drives, chaos.dead_turn_pids, chaos.answers
        )
        stats = {k: int(v) for k, v in chaos.ledger.client.hgetall("chaos:stats").items()}
        restarts = chaos.restarts
        turn_restarts = chaos.turn_restarts
        turn_kills = chaos.ledger.client.lrange(chaos_app.TURN_KILLS, 0, -1)
        unplanned = sorted(chaos.dead_turn_pids - {int(k.split()[0]) for k in turn_kills})
        restart_failures = list(chaos.restart_failures)
        longest_down = chaos.longest_down
        reaped = dict(chaos.reaped)
        reaped_runs = dict(chaos.reaped_runs)
        disturbed = dict(chaos.disturbed)
        longest_of = dict(chaos.longest_of)
        disturb_failures = list(chaos.disturb_failures)
        retried = dict(chaos.retried)
    finally:
        chaos.shutdown()
    elapsed = time.monotonic() - started
    kills = stats.get("kills_child", 0) + stats.get("kills_worker", 0) + stats.get("kills_turn", 0)
    escalated = findings.states.get("escalated", 0)
    print(
        "runs: "
        + ", ".join(f"{s} {findings.states.get(s, 0)}" for s in ("completed", "compensated"))
        + f", escalated {escalated}"
        + "".join(f", {s} {n}" for s, n in findings.states.items() if s not in _ENDS)
    )
    print(
        f"kills: {kills} (pool process {stats.get('kills_child', 0)}, whole worker "
        f"{stats.get('kills_worker', 0)}, turn worker {stats.get('kills_turn', 0)}; {restarts} "
        f"worker restarts ({turn_restarts} of the turn worker), each back within "
        f"{longest_down:.1f}s)"
    )
    hosted = figures["hosted"]
    print(
        f"hosted: {hosted.get('runs', 0)} runs, {hosted.get('turns', 0)} turns recorded, "
        f"{hosted.get('model_calls', 0)} model calls ({hosted.get('repeated_after_kill', 0)} "
        f"made again after their turn worker was killed), "
        f"{hosted.get('early_refused', 0)} early irreversible calls refused"
    )
    if args.store != "redis" or args.broker != "redis":
        print(
            "disturbed: "
            + (
                ", ".join(
                    f"{k} {v} (longest {longest_of.get(k, 0.0):.1f}s"
                    + (
                        f", replica promoted within {longest_of[PROMOTED]:.1f}s"
                        if k == "masters killed" and PROMOTED in longest_of
                        else ""
                    )
                    + ")"
                    for k, v in sorted(disturbed.items())
                )
                or "nothing"
            )
            + f" (the longest took {chaos.longest_disturbance:.1f}s); the agent retried: "
            + (", ".join(f"{k} {v}" for k, v in sorted(retried.items())) or "nothing")
        )
    for failure in disturb_failures:
        print(f"disturbance failed: {failure}")
    for pid in unplanned:
        print(f"turn worker {pid} died without a planned kill")
    for failure in restart_failures:
        print(f"worker restart failed: {failure}")
    print(
        f"injected failures: {stats.get('failures', 0)} in steps, "
        f"{stats.get('undo_failures', 0)} in compensations"
    )
    print(
        f"compensations run: {figures['undo_applications']} applied in the ledger "
        f"({figures['compensations_done']} confirmed done, {figures['compensations_failed']} "
        "failed for good)"
    )
    print(f"escalations: {figures['escalation_records']} records for {escalated} escalated runs")
    answered = ", ".join(f"{k} {v}" for k, v in sorted(figures["answered"].items()))
    print(
        f"a person asked: {figures['questions']} costly refunds ({answered or 'none'}; "
        f"{figures['compensations_kept']} kept on purpose)"
    )
    reconciled = ", ".join(f"{k} {v}" for k, v in sorted(figures["reconciled"].items()))
    print(
        f"redelivered executions: {figures['redelivered']}; in-doubt steps reconciled: "
        f"{reconciled or 'none'}; reaper: "
        + ", ".join(f"{k} {v}" for k, v in sorted(reaped.items()) if v)
    )
    slowest = max(drives, key=lambda d: d.elapsed) if drives else None
    print(
        f"elapsed: {elapsed:.1f}s (runs driven by {driven:.1f}s, all ended by {settled:.1f}s"
        + (f"; slowest run {slowest.run_id} {slowest.elapsed:.1f}s" if slowest else "")
        + ")"
    )
    for run_id, actions in sorted(reaped_runs.items()):
        kind = plans[int(run_id.rsplit("r", 1)[1])]["kind"]
        print(f"reaper resolved {run_id} [{kind}]: {', '.join(actions)}")
    for what, count in sorted(findings.notes.items()):
        print(f"note: {what}: {count} (e.g. {findings.note_examples[what]})")
    for open_run in stuck:
        print(f"still open after the wait: {open_run}")
    for violation in findings.violations[:50]:
        print(f"VIOLATION {violation}")
    if len(findings.violations) > 50:
        print(f"... and {len(findings.violations) - 50} more")
    if args.json is not None:
        report = {
            "runs": len(drives),
            "seed": args.seed,
            "plans_sha256": digest(plans),
            "states": dict(findings.states),
            "kills": kills,
            "stats": stats,
            "restarts": restarts,
            "store": args.store,
            "broker": args.broker,
            "disturbed": disturbed,
            "disturbed_longest": {k: round(v, 1) for k, v in longest_of.items()},
            "disturb_failures": disturb_failures,
            "agent_retries": retried,
            "figures": {k: v for k, v in figures.items() if k not in ("reconciled", "answered")},
            "answered": dict(figures["answered"]),
            "reconciled": dict(figures["reconciled"]),
            "violations": findings.violations,
            "notes": dict(findings.notes),
            "elapsed": round(elapsed, 1),
        }
        args.json.write_text(json.dumps(report, indent=2))
    print(f"chaos: {len(drives)} runs, {kills} kills, {len(findings.violations)} violations")
    return 1 if findings.violations else 0


_ENDS = ("completed", "compensated", "escalated")


def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    try:
        sys.exit(main())
    except KeyboardInterrupt as stopped:  # its workers and Redis are stopped by now
        print(f"chaos: stopped ({stopped or 'interrupted'})", file=sys.stderr)
        sys.exit(130)
