"""Calling a run's Lua scripts: the one way the store changes a run.

A change touching more than one key must be atomic, so it is a script (``saga/lua``) run by
Redis, never a sequence of commands from a worker that may die in between. This module owns
what every such call shares, so the store's other modules only name a script and its
arguments: loading the scripts (their texts: ``saga.script_sources``), calling
them by SHA (alone or in one pipeline, loaded again when Redis restarted and forgot them),
reading their answer (``Outcome``, an illegal transition logged), the Redis clock they record
with, and turning Redis being away or failing over into a saga error (``reachable``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import NoScriptError, RedisClusterException

from saga.constants import (
    CONFIRM_PROBE_KEY,
    IndexLayout,
    confirm_probe_key,
    run_keys,
    script_keys,
    settled_key,
)
from saga.errors import ConfigurationError, StoreUnavailableError
from saga.redis_errors import unavailable
from saga.script_sources import script_sources

#: The store's own logger name (an operator's logging configuration names it).
logger = logging.getLogger("saga.stack")

#: Seconds between two measurements of this host's clock against the Redis server's.
_CLOCK_RESYNC = 60.0

#: Answers of the scripts that mean "this transition is not in the table" (saga/machine.py).
ILLEGAL = "illegal"

#: The writes a failover must not lose, which replicas confirm when the deployment asks
#: (``Settings.replicas_to_confirm``): a run's creation, an undo pushed (before the step's
#: message is acked) or found by a lookup, the unwind's ownership (a failure, an abort, a
#: take-over), a compensation's outcome, the conclusion, an approval's decision, a requeue
#: and a resolution. The others (a reservation, a step begun, a retry counted, a chain marked
#: sent, a record marked written) are repeated or reconciled when lost.
CONFIRMED_SCRIPTS = frozenset(
    {
        "create",
        "record_success",
        "resolve_in_doubt",
        "record_failure",
        "abort",
        "take_over",
        "record_compensation",
        "conclude",
        "decide_approval",
        # A model call is made only once its ask is on a replica, and its answer counts only
        # there: a failover never makes a turn ask the model again.
        "ask_model",
        "record_answer",
        "requeue",
        "resolve",
        # A person's answer about a reversal, and its expiry: the unwind goes on from it.
        "decide_reversal",
    }
)


@dataclass(frozen=True)
class ReplicaConfirmation:
    """How many replicas must hold a ``CONFIRMED_SCRIPTS`` write before it counts (``WAIT``
    after it), and how long to wait for them. Fewer in time: ``StoreUnavailableError`` (the
    write stands on the master; every script answers the same call again with what it
    decided, so repeating it converges and waits again)."""

    replicas: int = 0
    timeout_ms: int = 1000

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ConfigurationError(f"replicas to confirm must be 0 or more, not {self.replicas}")
        if self.replicas and self.timeout_ms <= 0:  # WAIT 0 would block a worker for good
            raise ConfigurationError(
                f"the replicas' confirmation needs a timeout above 0 ms, not {self.timeout_ms}"
            )

    def wanted(self, script: str) -> bool:
        return self.replicas > 0 and script in CONFIRMED_SCRIPTS

    def check(self, script: str, confirmed: int) -> None:
        if confirmed < self.replicas:
            raise StoreUnavailableError(
                f"Redis: {script} was confirmed by {confirmed} of {self.replicas} replica(s) "
                f"within {self.timeout_ms} ms; it stands on the master only, and the same "
                "call again converges"
            )


def _load_scripts(client: redis.Redis) -> dict[str, Script]:
    return {name: client.register_script(text) for name, text in script_sources().items()}


@dataclass(frozen=True)
class Outcome:
    """What a script answered: a status word and whatever came with it."""

    status: str
    values: tuple[Any, ...] = ()

    @property
    def owns_unwind(self) -> bool:
        """True when this caller came to own the run's unwind (it must start it)."""
        return (
            self.status in ("ok", "dup", "skip", "failed", "late", "repeat")
            and bool(self.values)
            and self.values[0] in (1, "1")
        )

    @property
    def pushed(self) -> bool:
        """True when the script that made this caller the unwind's owner also pushed its
        chain and marked it sent (``RunTransitions.record_failure_and_push``)."""
        return self.owns_unwind and len(self.values) > 2 and self.values[2] in (1, "1")


class StoreCore:
    """What every part of the store (``saga.stack.RunStore``) is built on: the Redis client,
    the registered scripts, the way to call them, and the server's clock."""

    def __init__(
        self,
        client: redis.Redis,
        retention_seconds: int,
        confirmation: ReplicaConfirmation | None = None,
        layout: IndexLayout | None = None,
    ) -> None:
        self.client = client
        self.retention_seconds = retention_seconds
        self.confirmation = confirmation or ReplicaConfirmation()
        #: A Redis Cluster: commands on keys of different slots never share a transaction,
        #: and a pipeline over several nodes keeps no order between them.
        self.clustered = isinstance(client, RedisCluster)
        self.layout = layout or IndexLayout()
        self._scripts = _load_scripts(client)
        self._offset = 0.0
        self._offset_measured = float("-inf")

    def _call(
        self,
        script: str,
        run_id: str,
        *args: Any,
        step: int | None = None,
        extra: str | Sequence[str] = (),
    ) -> Outcome:
        keys = script_keys(run_id)
        if step is not None:
            keys.append(settled_key(run_id, step))
        if isinstance(extra, str):
            keys += [extra] if extra else []
        else:
            keys += extra
        with reachable(script):
            raw = self._evalsha(script, keys, args)
            self._confirm(script, run_id)
        return outcome_of(script, run_id, raw, args)

    def _evalsha(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Script ``name`` by its SHA; once more after loading it if Redis did not have it (a
        restarted server, or a replica a failover promoted: Redis replicates no script)."""
        sha = self._scripts[name].sha
        try:
            return self.client.evalsha(sha, len(keys), *keys, *args)
        except NoScriptError:
            self._load(name)
        try:
            return self.client.evalsha(sha, len(keys), *keys, *args)
        except NoScriptError as exc:
            raise still_missing(name) from exc

    def _load(self, name: str) -> None:
        """Load script ``name`` on the server that answered NOSCRIPT. On a cluster that is
        every node the client knows of, replicas included: right after a failover its map may
        still call the promoted master a replica (a topology read from a node that had not
        heard of the promotion), and a load on "the masters" would miss the one that asked."""
        text = self._scripts[name].script
        if not self.clustered:
            self.client.script_load(text)
            return
        cluster: Any = self.client
        for node in cluster.get_nodes():
            try:
                cluster.get_redis_connection(node).script_load(text)
            except redis.RedisError:
                continue  # a node away: if it is the run's, the call after says so

    def confirm(self, what: str, run_id: str) -> None:
        """Wait for the replicas to hold every write made so far, as after a write that counts
        (``ReplicaConfirmation``; nothing to wait for without it): ``StoreUnavailableError``
        when fewer hold it in time. For a write that counts only at some moments (a step's
        reservation, once its message is about to be sent)."""
        if self.confirmation.replicas:
            with reachable(what):
                self._wait_for_replicas(what, run_id)

    def _confirm(self, script: str, run_id: str) -> None:
        """Wait for the replicas to hold what ``script`` wrote on ``run_id``'s keys, when it is
        a write that counts (``ReplicaConfirmation``); inside the caller's ``reachable``."""
        if self.confirmation.wanted(script):
            self._wait_for_replicas(script, run_id)

    def confirm_keys(self, what: str, keys: Sequence[str]) -> None:
        """``confirm`` for writes to ``keys`` outside any run's slot (a new run's index
        entries, on a cluster on another master than the run's): each slot's master waits."""
        if self.confirmation.wanted(what):
            with reachable(what):
                for probe in dict.fromkeys(confirm_probe_key(key) for key in keys):
                    self._wait_on(what, probe)

    def _wait_for_replicas(self, what: str, run_id: str) -> None:
        """``WAIT`` counts the writes of its own connection only, and the pool may lend the
        ``WAIT`` another connection than the write's (another thread took that one back in
        between): so a write goes first on the same connection, one that follows every write
        made so far in the replication stream (``CONFIRM_PROBE_KEY``). On a cluster ``WAIT``
        is one node's: the probe is in the run's slot, sent to the master serving it."""
        if self.clustered:
            self._wait_on(what, confirm_probe_key(run_keys(run_id)[0]))
            return
        wanted = self.confirmation
        with self.client.pipeline(transaction=False) as pipe:
            pipe.incr(CONFIRM_PROBE_KEY)
            pipe.wait(wanted.replicas, wanted.timeout_ms)
            confirmed = pipe.execute()[-1]
        wanted.check(what, int(confirmed))

    def _wait_on(self, what: str, probe: str) -> None:
        """On a cluster: the probe written and ``WAIT`` sent on one connection to the master
        serving the probe's slot."""
        wanted = self.confirmation
        node = self.client.get_node_from_key(probe)  # type: ignore[attr-defined]
        with node.redis_connection.pipeline(transaction=False) as pipe:
            pipe.set(probe, "1", px=max(wanted.timeout_ms * 2, 60_000))
            pipe.wait(wanted.replicas, wanted.timeout_ms)
            confirmed = pipe.execute()[-1]
        wanted.check(what, int(confirmed))

    def servers(self) -> list[redis.Redis]:
        """A client of each server holding the store: the master's, or on a cluster each
        master's (what a check of the servers' own settings, eviction or AOF, must read)."""
        if self.clustered:
            primaries = self.client.get_primaries()  # type: ignore[attr-defined]
            return [node.redis_connection for node in primaries]
        return [self.client]

    def now(self, exact: bool = False) -> float:
        """The Redis server's clock, the one every script records: this host's clock corrected
        by an offset measured with ``TIME`` once a minute (no round trip on each call), or,
        ``exact``, read right now (what judging a run idle needs: a host clock that jumped
        must not make every run look abandoned)."""
        host = time.time()
        if exact or host - self._offset_measured > _CLOCK_RESYNC:
            with reachable("time"):
                seconds, micros = self.client.time()
            self._offset = float(seconds) + micros / 1_000_000 - time.time()
            self._offset_measured = host
        return time.time() + self._offset

    def _pipelined(
        self, name: str, run_id: str, queue: Callable[[Any], None], *, transaction: bool
    ) -> list[Any]:
        """Run the commands ``queue`` puts on a pipeline (script ``name`` among them) in one
        round trip; once more after loading the script if Redis did not have it (it
        restarted): every command queued must be safe to repeat."""
        with reachable(name):
            for attempt in (1, 2):
                with self.client.pipeline(transaction=transaction) as pipe:
                    queue(pipe)
                    answers: list[Any] = pipe.execute(raise_on_error=False)
                if attempt == 1 and script_missing(answers):
                    self._load(name)
                    continue
                break
            if script_missing(answers):
                raise still_missing(name)
            raise_first_error(answers)
            self._confirm(name, run_id)
        return answers


def queue_script(
    pipe: Any, sha: str, run_id: str, args: Sequence[Any], extra: Sequence[str] = ()
) -> None:
    """Queue the script of ``sha`` on ``pipe`` (sync or asyncio) by its SHA alone: redis-py's
    own pipelined scripts cost a SCRIPT EXISTS round trip on every execute. ``extra``: the
    keys after the run's (``KEYS[7]`` on)."""
    keys = [*script_keys(run_id), *extra]
    pipe.evalsha(sha, len(keys), *keys, *args)


def script_missing(answers: Sequence[Any]) -> bool:
    """A pipeline's answers say Redis did not have a script (it restarted): load and repeat."""
    return any(isinstance(answer, NoScriptError) for answer in answers)


def still_missing(name: str) -> StoreUnavailableError:
    """A script missing right after it was loaded: the server serving the run changed in
    between (a failover going on). The caller retries, as for the store being away."""
    return StoreUnavailableError(
        f"saga store unreachable ({name}): its server did not hold the script right after it "
        "was loaded (a failover going on)"
    )


def raise_first_error(answers: Sequence[Any]) -> None:
    """A pipeline run with ``raise_on_error=False`` fails as its first failed command."""
    for answer in answers:
        if isinstance(answer, Exception):
            raise answer


def outcome_of(script: str, run_id: str, raw: Any, args: Any) -> Outcome:
    """A script's answer as an ``Outcome``; a transition its table refused is logged."""
    outcome = Outcome(str(raw[0]), tuple(raw[1:])) if isinstance(raw, list) else Outcome(str(raw))
    if outcome.status == ILLEGAL:
        machine, source, event = (str(v) for v in outcome.values)
        logger.error(
            "run %s: refused %s transition %r --%s--> (not in saga/machine.py's table; %s %s)",
            run_id,
            machine,
            source,
            event,
            script,
            list(args)[:1],
        )
    return outcome


@contextmanager
def reachable(what: str) -> Iterator[None]:
    """Redis being away, or failing over (``saga.redis_errors``), is a saga error the caller
    can retry, not a library traceback."""
    try:
        yield
    except redis.AuthenticationError as exc:  # retrying will not fix a wrong password
        raise ConfigurationError(f"the saga store refused the credentials ({what}): {exc}") from exc
    except (redis.RedisError, ConnectionResetError, RedisClusterException) as exc:
        if not unavailable(exc):
            raise
        raise StoreUnavailableError(f"saga store unreachable ({what}): {exc}") from exc
