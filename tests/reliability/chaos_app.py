"""The Celery app and tools of the randomised chaos run (``python -m tests.reliability.chaos``).

Workers run it as ``celery -A tests.reliability.chaos_app worker``. Every tool acts on a
side-effect ledger of its own in Redis (keys ``chaos:*``, on the chaos run's private Redis) and
honours its idempotency key as a real API would: the first call with a key applies the effect
and records an *application*; every later call with that key replays the recorded result. Each
call, replay or not, bumps an *execution* counter (redeliveries show there), and each
application takes a global sequence number, so the order of undos can be checked afterwards.
The checker (``chaos.py``) counts effects in this ledger, never in the saga's own records.

Faults are planned per run: the runner writes ``chaos:plan:<run_id>`` before the run starts,
and the tools act on it themselves at two points of each call, before and after the effect:
raise, SIGKILL their pool process, or SIGKILL the whole worker (the runner restarts it). A
fault named ``fail:<step>`` / ``kill:<step>`` (``cfail``/``ckill`` for the step's compensation)
fires on the calls ``nth`` to ``nth + times - 1`` of that run (counted in
``chaos:fired:<run_id>``), so a "kill once" lets the redelivered message go through.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import redis
from celery import Celery

from saga import (
    NonRetryableToolError,
    RetryPolicy,
    Saga,
    StepContext,
    ToolClass,
    ToolRegistry,
    Undo,
)

#: Prefix of every ledger key.
PREFIX = "chaos"
APPLIED = f"{PREFIX}:applied"  # hash: idempotency key -> application record (JSON)
EXECUTIONS = f"{PREFIX}:executions"  # hash: idempotency key -> calls, replays included
SEQUENCE = f"{PREFIX}:seq"  # global order of applications
STATS = f"{PREFIX}:stats"  # hash: what the tools injected (kills, failures)
ANOMALIES = f"{PREFIX}:anomalies"  # list: things no correct caller can make a tool see
#: Set in the workers' environment only: a tool kills its process only where this says so.
WORKER_ENV = "SAGA_CHAOS_WORKER"

#: Fast policies keep the run short; the visibility timeout (6 s) stays far above them.
FAST = RetryPolicy(attempts=3, backoff=0.1, backoff_max=0.5)
FAST_UNDO = RetryPolicy(attempts=3, backoff=0.1, backoff_max=0.5)


def slot_key(slot: int) -> str:
    return f"{PREFIX}:slot:{slot}"


def tag_key(slot: int) -> str:
    return f"{PREFIX}:tag:{slot}"


def balance_key(account: str) -> str:
    return f"{PREFIX}:balance:{account}"


def charge_key(charge_id: str) -> str:
    return f"{PREFIX}:charge:{charge_id}"


def outbox_key(to: str) -> str:
    return f"{PREFIX}:outbox:{to}"


def plan_key(run_id: str) -> str:
    return f"{PREFIX}:plan:{run_id}"


def fired_key(run_id: str) -> str:
    return f"{PREFIX}:fired:{run_id}"


# One script applies any effect, atomically with its idempotency check and its records.
# KEYS: applied, executions, sequence, target, anomalies
# ARGV: idempotency key, kind, meta (JSON: run, step, undo, tool, args), value, cents
_APPLY = """
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
local done = redis.call('HGET', KEYS[1], ARGV[1])
if done then return done end
local kind, value = ARGV[2], ARGV[4]
local meta = cjson.decode(ARGV[3])
local result
if kind == 'refund' then
  -- A payments API refuses to refund a charge it never made (or one refunded already).
  local charge = KEYS[4]
  if redis.call('EXISTS', charge) == 0 then
    redis.call('RPUSH', KEYS[5], 'refund of unknown charge ' .. value .. ' by ' .. ARGV[1])
    return redis.error_reply('unknown charge ' .. value)
  end
  local refunds = redis.call('HINCRBY', charge, 'refunds', 1)
  if refunds > 1 then
    redis.call('RPUSH', KEYS[5], 'charge ' .. value .. ' refunded again by ' .. ARGV[1])
  end
  local account = redis.call('HGET', charge, 'account')
  redis.call('DECRBY', ARGV[6] .. account, redis.call('HGET', charge, 'cents'))
end
local seq = redis.call('INCR', KEYS[3])
if kind == 'put' then
  local previous = redis.call('GET', KEYS[4])
  if not previous then previous = '' end
  redis.call('SET', KEYS[4], value)
  result = {slot = meta.args.slot, previous = previous}
elseif kind == 'tag' then
  redis.call('SET', KEYS[4], value)
  result = {slot = meta.args.slot, value = value}
elseif kind == 'charge' then
  local id = 'ch-' .. seq
  redis.call('INCRBY', KEYS[4], ARGV[5])
  redis.call('HSET', ARGV[6] .. id, 'account', meta.args.account, 'cents', ARGV[5],
    'key', ARGV[1], 'refunds', 0)
  result = {charge_id = id}
elseif kind == 'refund' then
  result = {refund_id = 'rf-' .. seq, charge_id = value}
elseif kind == 'notify' then
  redis.call('RPUSH', KEYS[4], ARGV[1])
  result = {message_id = 'msg-' .. seq, to = meta.args.to}
else
  return redis.error_reply('unknown kind ' .. kind)
end
meta.seq = seq
meta.result = result
local record = cjson.encode(meta)
redis.call('HSET', KEYS[1], ARGV[1], record)
return record
"""


class Ledger:
    """The chaos run's world: slots, tags, accounts, an outbox, and who applied what."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = redis.Redis.from_url(url, decode_responses=True)
        self._apply = self.client.register_script(_APPLY)

    def apply(
        self, ctx: StepContext, tool: str, kind: str, args: dict[str, Any], target: str, **kw: Any
    ) -> dict[str, Any]:
        meta = {
            "run": ctx.run_id,
            "step": ctx.step,
            "undo": ctx.compensating,
            "tool": tool,
            "args": args,
        }
        raw = self._apply(
            keys=[APPLIED, EXECUTIONS, SEQUENCE, target, ANOMALIES],
            args=[
                ctx.idempotency_key,
                kind,
                json.dumps(meta),
                str(kw.get("value", "")),
                str(kw.get("cents", 0)),
                f"{PREFIX}:balance:" if kind == "refund" else f"{PREFIX}:charge:",
            ],
        )
        return dict(json.loads(raw)["result"])

    def executed(self, ctx: StepContext) -> None:
        self.client.hincrby(EXECUTIONS, ctx.idempotency_key, 1)

    def application(self, idempotency_key: str) -> dict[str, Any] | None:
        raw = self.client.hget(APPLIED, idempotency_key)
        return None if raw is None else dict(json.loads(raw))

    def strike(self, ctx: StepContext, point: str) -> None:
        """Act on this run's fault plan at ``point`` ("before" or "after" the effect)."""
        prefix = "c" if ctx.compensating else ""
        wanted = [f"{prefix}{kind}:{ctx.step}" for kind in ("fail", "kill")]
        specs = self.client.hmget(plan_key(ctx.run_id), wanted)
        for name, raw in zip(wanted, specs, strict=True):
            if raw is None:
                continue
            spec = json.loads(raw)
            if spec["point"] != point:
                continue
            fired = self.client.hincrby(fired_key(ctx.run_id), name, 1)
            first = int(spec.get("nth", 1))  # fires on calls nth .. nth + times - 1
            if not first <= fired < first + int(spec["times"]):
                continue
            where = f"{name} {point} the effect of {ctx.idempotency_key} (#{fired})"
            if name.startswith(("fail", "cfail")):
                self.client.hincrby(STATS, "undo_failures" if prefix else "failures", 1)
                if spec.get("final"):
                    raise NonRetryableToolError(f"chaos: refused at {where}")
                raise ChaosFault(f"chaos: failed at {where}")
            if os.environ.get(WORKER_ENV) != "1":  # never kill a process that is not a worker
                raise ChaosFault(f"chaos: would have killed at {where}")
            if spec.get("whole_worker"):
                self.client.hincrby(STATS, "kills_worker", 1)
                os.killpg(os.getpgid(0), signal.SIGKILL)
            self.client.hincrby(STATS, "kills_child", 1)
            os.kill(os.getpid(), signal.SIGKILL)


class ChaosFault(Exception):
    """A retryable failure the plan injected (an ordinary exception: the saga retries it)."""


_ledger: Ledger | None = None


def configure(url: str) -> Ledger:
    """Point the tools (and lookups run in this process, by the reaper) at ``url``."""
    global _ledger
    _ledger = Ledger(url)
    return _ledger


def ledger() -> Ledger:
    if _ledger is None:
        url = os.environ.get("SAGA_REDIS_URL") or os.environ.get("SAGA_BROKER_URL")
        if not url:
            raise RuntimeError("the chaos ledger needs SAGA_REDIS_URL (or configure(url))")
        return configure(url)
    return _ledger


def _lookup(idempotency_key: str, _args: dict[str, Any]) -> Any:
    """Find a step's effect by its key, as a real API's "get by idempotency key" would."""
    record = ledger().application(idempotency_key)
    return None if record is None else record["result"]


def _apply(
    ctx: StepContext, tool: str, kind: str, args: dict[str, Any], target: str, **kw: Any
) -> dict[str, Any]:
    book = ledger()
    book.strike(ctx, "before")
    result = book.apply(ctx, tool, kind, args, target, **kw)
    book.strike(ctx, "after")
    return result


tools = ToolRegistry()


@tools.tool(ToolClass.READ, retry=FAST)
def peek(ctx: StepContext, slot: int) -> dict[str, Any]:
    """Read a slot (class 1: no effect, nothing to undo)."""
    book = ledger()
    book.strike(ctx, "before")
    book.executed(ctx)
    value = book.client.get(slot_key(slot))
    book.strike(ctx, "after")
    return {"slot": slot, "value": value or ""}


@tools.tool(ToolClass.CONVERGENT_WRITE, retry=FAST, lookup=_lookup)
def tag(ctx: StepContext, slot: int, value: str) -> dict[str, Any]:
    """Set a tag to a desired value (class 2: converges on retry, kept on unwind)."""
    args = {"slot": slot, "value": value}
    return _apply(ctx, "tag", "tag", args, tag_key(slot), value=value)


def _restore(args: dict[str, Any], result: dict[str, Any]) -> Undo:
    return Undo(
        "put",
        {"slot": result["slot"], "value": result["previous"]},
        f"put slot {result['slot']} back to {result['previous']!r}",
    )


@tools.tool(ToolClass.REVERSIBLE_WRITE, compensation=_restore, retry=FAST, lookup=_lookup)
def put(ctx: StepContext, slot: int, value: str) -> dict[str, Any]:
    """Overwrite a slot (class 3: undone by putting the captured previous value back)."""
    args = {"slot": slot, "value": value}
    return _apply(ctx, "put", "put", args, slot_key(slot), value=value)


def _refund(args: dict[str, Any], result: dict[str, Any]) -> Undo:
    return Undo(
        "refund",
        {"charge_id": result["charge_id"]},
        f"refund {result['charge_id']} ({args['cents']} cents to {args['account']})",
    )


@tools.tool(ToolClass.COMPENSATABLE_WRITE, compensation=_refund, retry=FAST, lookup=_lookup)
def charge(ctx: StepContext, account: str, cents: int) -> dict[str, Any]:
    """Charge an account (class 4: undone by a visible refund of the captured charge id)."""
    args = {"account": account, "cents": cents}
    return _apply(ctx, "charge", "charge", args, balance_key(account), cents=cents)


@tools.compensation(retry=FAST_UNDO)
def refund(ctx: StepContext, charge_id: str) -> dict[str, Any]:
    """Refund a charge, once per idempotency key; an unknown charge is refused for good."""
    try:
        return _apply(
            ctx,
            "refund",
            "refund",
            {"charge_id": charge_id},
            charge_key(charge_id),
            value=charge_id,
        )
    except redis.ResponseError as exc:
        raise NonRetryableToolError(f"refund refused: {exc}") from exc


@tools.tool(ToolClass.IRREVERSIBLE_WRITE, retry=FAST, lookup=_lookup)
def notify(ctx: StepContext, to: str) -> dict[str, Any]:
    """Send a message (class 5: once sent it is gone; the pivot)."""
    return _apply(ctx, "notify", "notify", {"to": to}, outbox_key(to))


app = Celery("saga-chaos")
app.config_from_object("celeryconfig")
# A message stranded by a whole-worker kill comes back at the first sweep for unacknowledged
# messages past the visibility timeout: sweep every second (kombu's own default is every 100 s),
# and let a sweep lock left behind by a killed worker expire in 10 s (kombu: 300 s).
app.conf.broker_transport_options = {
    **app.conf.broker_transport_options,
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
    "unacked_mutex_expire": 10,
}

saga = Saga(app, tools)
