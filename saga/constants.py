"""Names that outlive a deploy: Redis keys and Celery task names.

They live here, spelled out, so a rename of a module never orphans a queued message or a stack.
Every key of one run shares the hash tag ``{run_id}`` so the Lua scripts also work on Redis
Cluster, where all keys a script touches must sit in one slot.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

KEY_PREFIX = "saga"
#: Written (an INCR) just before each replica confirmation's ``WAIT``, on the same connection:
#: ``WAIT`` counts only its own connection's writes (``saga.store_scripts``).
CONFIRM_PROBE_KEY = f"{KEY_PREFIX}:confirm"

#: Sorted set of runs not yet ended, for the reaper (outside any run's hash tag).
ACTIVE_RUNS_KEY = f"{KEY_PREFIX}:active"
#: Seconds after a recorded run's keys expire that the reaper looks at it (to drop it from
#: its index).
LOOK_AFTER_EXPIRY = 60.0
#: The agents the workers host, by name (JSON: deadline, tools, approval), published by each
#: worker as it starts: what lets a web app refuse a run of an agent no worker runs.
AGENTS_KEY = f"{KEY_PREFIX}:agents"
#: The tools the workers run (name → when a worker last said so), published by each worker as
#: it starts: a caller refuses at once a call no worker would take (``saga.tool_hosts``).
WORKER_TOOLS_KEY = f"{KEY_PREFIX}:tools:workers"
#: The tools callers know (name → when a caller last said so), published by each process's
#: ``Saga`` on its first call: what a starting worker and ``saga doctor`` compare against.
CALLER_TOOLS_KEY = f"{KEY_PREFIX}:tools:callers"
#: How the workers' ``Saga`` is imported (``module:attr``), published by each worker as it
#: starts: the ``--app`` a ``saga`` command run without one prints in the commands it shows.
WORKER_APP_KEY = f"{KEY_PREFIX}:workers:app"
#: Sorted set of the runs whose keys are in Redis, scored by their creation time (the run
#: hash's ``created``): what a listing pages through, newest first. ``create.lua`` adds a run,
#: the reaper drops it with the reaper's index once its keys are gone.
CREATED_RUNS_KEY = f"{KEY_PREFIX}:created"
#: Sorted set of the runs that asked a person about a call, scored by when they first did:
#: what lists every call awaiting approval without reading the whole history. Added to before
#: the request is written (so a waiting call is never missing from it); a run leaves it once
#: it no longer runs (the listing drops it) or its keys are gone (``forget``).
AWAITING_APPROVAL_KEY = f"{KEY_PREFIX}:awaiting-approval"
#: When the beat-scheduled reaper last finished a pass (Redis clock): ``saga doctor`` reads it
#: to tell that beat and a worker are alive.
REAPER_PASS_KEY = f"{KEY_PREFIX}:reaper:last-pass"
#: A console login session (``<prefix><SHA-256 of the cookie>``: the token's id and when it
#: was opened), expiring with the session. Neither the cookie nor the CSRF token is stored.
WEB_SESSION_PREFIX = f"{KEY_PREFIX}:web:session:"
#: Sorted set of one token's console sessions (``<prefix><token id>``: session digests scored
#: by when they were opened), so the oldest is ended beyond the cap.
WEB_TOKEN_SESSIONS_PREFIX = f"{KEY_PREFIX}:web:sessions-of:"
#: Sorted set of one session's open live streams (``<prefix><session digest>``: stream ids
#: scored by when each last checked in), so a session holds only a few.
WEB_SESSION_STREAMS_PREFIX = f"{KEY_PREFIX}:web:streams-of:"
#: The key that signs the login form's CSRF value, made once by whichever server first needs it.
WEB_LOGIN_KEY = f"{KEY_PREFIX}:web:login-key"
#: How many ways the cross-run indexes (the reaper's, the listing's, the awaiting-approval one)
#: are sharded on this store, written once by the first process that shards them (absent: one
#: shard, the unsharded keys above). A process configured otherwise refuses to start
#: (``saga.store_indexes``), so no index is ever half-read.
INDEX_LAYOUT_KEY = f"{KEY_PREFIX}:index-layout"
#: Fault-injection rules and their counters (saga.testing), read only when explicitly enabled.
FAULTS_KEY = f"{KEY_PREFIX}:{{testing}}:faults"
FAULT_COUNTS_KEY = f"{KEY_PREFIX}:{{testing}}:fault-counts"

#: Celery task name of a tool: ``tools.issue_credit``.
TOOL_TASK_PREFIX = "tools."
#: Celery task that closes an unwind once its compensation chain has run.
CONCLUDE_UNWIND_TASK = "saga.conclude_unwind"
#: Celery beat task that resolves runs with no progress past their deadline.
REAP_TASK = "saga.reap"
#: One turn of a hosted agent: ask the model once, dispatch its calls (``saga.agents.hosted``).
AGENT_TURN_TASK = "saga.agent_turn"
#: Start the unwind a web app's ``abort_run`` came to own (the client holds no tool code).
START_UNWIND_TASK = "saga.start_unwind"
#: Deliver one escalation's notice to one sink (``saga.notifications``), retried with backoff.
NOTIFY_TASK = "saga.notify"
#: The queue turns run on: a threads pool, so a model call never holds a prefork slot.
TURN_QUEUE = "saga.turns"


def tool_task_name(tool: str) -> str:
    return f"{TOOL_TASK_PREFIX}{tool}"


def run_keys(run_id: str) -> list[str]:
    """The keys of one run, in the order every Lua script receives them.

    run      hash: state, pivot, counters, reason, version
    steps    hash: step number -> step record (JSON)
    inflight hash: step number -> tool class, for steps dispatched and not yet settled
    stack    list: compensation entries (JSON), oldest first
    comps    hash: step number -> compensation record (JSON)
    """
    base = f"{KEY_PREFIX}:{{{run_id}}}"
    return [f"{base}:run", f"{base}:steps", f"{base}:inflight", f"{base}:stack", f"{base}:comps"]


def agent_key(run_id: str) -> str:
    """The hosted loop's hash of one run (absent for a run driven by ``run.call``).

    name, input, created       the agent and what it was asked
    model_calls                every call of its policy (a redelivered turn must not add one)
    tokens_in, tokens_out      usage, summed over the recorded answers
    bytes                      size of the stored transcript
    turn                       the latest turn with a recorded answer
    <k>:answer                 turn k's answer (a ModelTurn as JSON), first writer wins
    <k>:calls                  how many calls that answer makes (what advancing checks)
    <k>:asked                  policy calls made for turn k (more than one after a retry)
    <k>:asker                  the token of turn k's last asker, until it records an answer
                               or gives its call up: a lease that ran out under it is fenced
    <k>:claim                  "token first_ms last_ms": a delivery fencing that asker
    <k>:results                the results turn k's calls returned to the model (JSON)
    <k>:<i>:refused            why call i of turn k was not dispatched (fed back to the model)
    <k>:advanced               turn k+1 was enqueued (or the run ended): first writer wins
    ended                      why the loop stopped (final answer, limit, model error)

    The call -> step map lives in the steps hash (``call:<k>:<i>``), written by the reserve
    script itself. Every script receives this key sixth, after ``run_keys``.
    """
    return f"{KEY_PREFIX}:{{{run_id}}}:agent"


def script_keys(run_id: str) -> list[str]:
    """The keys every Lua script receives: ``run_keys`` and the agent hash."""
    return [*run_keys(run_id), agent_key(run_id)]


def turn_lease_key(run_id: str, turn: int) -> str:
    """Held (SET NX, with an expiry) while one delivery of a turn asks the model."""
    return f"{KEY_PREFIX}:{{{run_id}}}:asking:{turn}"


def turn_task_id(run_id: str, turn: int) -> str:
    """The Celery task id of turn ``turn``: the same on every send, so Flower shows one task."""
    return f"{run_id}:turn:{turn}"


def call_marker(turn: int, call: int) -> str:
    """What the reserve script records with the step a turn's call got."""
    return f"{turn}:{call}"


def settled_key(run_id: str, step: int) -> str:
    """The list a client waiting on ``step`` blocks on; the scripts push when it settles."""
    return f"{KEY_PREFIX}:{{{run_id}}}:settled:{step}"


def ended_key(run_id: str) -> str:
    """The list a client waiting for the run's end blocks on; pushed once its record is
    written (``mark_recorded``)."""
    return f"{KEY_PREFIX}:{{{run_id}}}:ended"


def step_idempotency_key(run_id: str, step: int) -> str:
    return f"{run_id}:{step}"


def compensation_idempotency_key(run_id: str, step: int) -> str:
    return f"{run_id}:{step}:undo"


def notice_task_id(escalation_id: str, sink: str) -> str:
    """The Celery task id of a notice: the same on every send, so Flower shows one task."""
    return f"{escalation_id}:notify:{sink}"


def confirm_probe_key(key: str) -> str:
    """The replica confirmation's probe on a Redis Cluster, in ``key``'s slot: ``WAIT`` is per
    node, so the probe must be written on the node that took the writes to confirm. The slot
    is the hash tag's (``{run_id}``, ``{ix-3}``), or a whole untagged key's, which the probe
    then takes as its tag."""
    start = key.find("{")
    end = key.find("}", start + 1) if start != -1 else -1
    tag = key[start + 1 : end] if end > start + 1 else key
    return f"{KEY_PREFIX}:{{{tag}}}:confirm"


@dataclass(frozen=True)
class IndexLayout:
    """Where the cross-run indexes live: ``shards`` sorted sets of each kind, a run's entries
    in shard ``crc32(run_id) % shards`` of every kind.

    One shard is the unsharded keys (``ACTIVE_RUNS_KEY`` ...), what a store has always had.
    More are ``saga:{ix-<k>}:active`` and so on: each shard's three keys share one hash tag,
    so on a Redis Cluster a shard is one slot, and the shards spread over the masters (the
    reaper's and the listing's hot keys no longer sit on one node)."""

    shards: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.shards <= 1024:
            raise ValueError(f"the index shards must be 1 to 1024, not {self.shards}")

    def shard_of(self, run_id: str) -> int:
        return zlib.crc32(run_id.encode()) % self.shards if self.shards > 1 else 0

    def _key(self, shard: int, kind: str, unsharded: str) -> str:
        return unsharded if self.shards == 1 else f"{KEY_PREFIX}:{{ix-{shard}}}:{kind}"

    def active(self, shard: int) -> str:
        return self._key(shard, "active", ACTIVE_RUNS_KEY)

    def created(self, shard: int) -> str:
        return self._key(shard, "created", CREATED_RUNS_KEY)

    def awaiting(self, shard: int) -> str:
        return self._key(shard, "awaiting-approval", AWAITING_APPROVAL_KEY)

    def active_of(self, run_id: str) -> str:
        return self.active(self.shard_of(run_id))

    def created_of(self, run_id: str) -> str:
        return self.created(self.shard_of(run_id))

    def awaiting_of(self, run_id: str) -> str:
        return self.awaiting(self.shard_of(run_id))

    def entries_of(self, run_id: str) -> list[str]:
        """The keys a new run's index entries go to (the reaper's and the listing's)."""
        return [self.active_of(run_id), self.created_of(run_id)]

    def every(self, kind: str) -> list[str]:
        """Every shard's key of ``kind`` (``active``, ``created``, ``awaiting``)."""
        key = {"active": self.active, "created": self.created, "awaiting": self.awaiting}[kind]
        return [key(shard) for shard in range(self.shards)]
