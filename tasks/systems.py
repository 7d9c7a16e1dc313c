"""Three fake business systems for the saga demo: billing, tickets and an outbox.

Each system is its own SQLite file behind its own engine, so no database transaction can ever
span two of them. That is the situation a saga exists for: once a step has committed in one
system, a failure in the next can only be answered by a compensating action, never a rollback.
Compensation here works the way real money does: a reversal is a new ledger line that points at
the credit it cancels, and the credit line stays. Nothing is erased.

Every write takes an idempotency key so a redelivered task gets the first result back instead of
acting twice. Every service has fault switches kept in its own database, so a test or the demo
can make it slow, down or flaky from another process. Worker processes share these files, so
each write transaction starts with BEGIN IMMEDIATE: a check-then-write is then atomic.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

Record = dict[str, Any]


class ServiceUnavailableError(Exception):
    """A system refused the call the way a real one does in an outage, so a retry may work."""

    retryable = True


class CreditRefusedError(ValueError):
    """Billing refused the credit as asked (more than the order's total): nothing happened."""

    retryable = False


class NotFoundError(Exception):
    """The thing asked for does not exist, so no retry can help."""

    retryable = False


BILLING, TICKETS, OUTBOX = "billing.db", "tickets.db", "outbox.db"
SERVICES: dict[str, str] = {
    "orders": BILLING,
    "billing": BILLING,
    "reversal": BILLING,
    "tickets": TICKETS,
    "mail": OUTBOX,
    "webhook": OUTBOX,
}


def _int(name: str, *args: Any, **kw: Any) -> sa.Column[Any]:
    return sa.Column(name, sa.Integer, *args, nullable=kw.pop("nullable", False), **kw)


def _text(name: str, *args: Any, **kw: Any) -> sa.Column[Any]:
    return sa.Column(name, sa.Text, *args, nullable=kw.pop("nullable", False), **kw)


def _switch_table(metadata: sa.MetaData) -> sa.Table:
    """Each database carries its own switches, so a fault lives with the system it breaks."""
    return sa.Table(
        "service_switches",
        metadata,
        _text("service", primary_key=True),
        _int("down", default=0),
        _int("fail_next", default=0),
        sa.Column("delay_seconds", sa.Float, nullable=False, default=0.0),
    )


_billing_md, _tickets_md, _outbox_md = sa.MetaData(), sa.MetaData(), sa.MetaData()
_orders = sa.Table(
    "orders",
    _billing_md,
    _int("order_id", primary_key=True),
    _text("customer_email"),
    _int("total_cents"),
    _text("currency"),
)
_ledger = sa.Table(
    "ledger",
    _billing_md,
    _int("entry_id", primary_key=True),
    _int("order_id", sa.ForeignKey("orders.order_id")),
    _text("kind", sa.CheckConstraint("kind IN ('credit', 'reversal')")),
    _int("amount_cents"),
    # Unique: a credit can be reversed at most once, whatever key the caller sends.
    _int("reverses_entry_id", sa.ForeignKey("ledger.entry_id"), nullable=True, unique=True),
    _text("idempotency_key", unique=True),
    _text("memo", default=""),
    _text("created_at"),
    sqlite_autoincrement=True,
)
_tickets = sa.Table(
    "tickets",
    _tickets_md,
    _int("ticket_id", primary_key=True),
    _int("order_id"),
    _text("status"),
)
_ticket_keys = sa.Table(
    "ticket_applied_keys",
    _tickets_md,
    _text("idempotency_key", primary_key=True),
    _int("ticket_id"),
    _text("result"),
    _text("at"),
)
_history = sa.Table(
    "ticket_history",
    _tickets_md,
    _int("id", primary_key=True),
    _int("ticket_id"),
    _text("from_status"),
    _text("to_status"),
    _text("idempotency_key"),
    _text("at"),
)
_outbox = sa.Table(
    "outbox",
    _outbox_md,
    _int("id", primary_key=True),
    _text("channel", sa.CheckConstraint("channel IN ('mail', 'webhook')")),
    _text("recipient"),
    _text("subject", nullable=True),
    _text("body"),
    _text("idempotency_key", unique=True),
    _text("at"),
    sqlite_autoincrement=True,
)
_METADATA = {BILLING: _billing_md, TICKETS: _tickets_md, OUTBOX: _outbox_md}
_SWITCHES = {db: _switch_table(md) for db, md in _METADATA.items()}

_engines: dict[Path, sa.Engine] = {}
_engines_lock = threading.Lock()


def data_dir() -> Path:
    """Read the variable on every call so tests and the demo can switch directories at will."""
    return Path(os.environ.get("SAGA_DEMO_DATA", ".demo-data"))


def _on_connect(dbapi_conn: Any, _record: Any) -> None:
    """Take BEGIN away from pysqlite so _on_begin decides the lock mode; WAL lets reads overlap."""
    dbapi_conn.isolation_level = None
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _on_begin(conn: sa.Connection) -> None:
    """Writers lock at BEGIN, so a lookup followed by an insert cannot interleave with another."""
    mode = conn.get_execution_options().get("sqlite_begin", "IMMEDIATE")
    conn.exec_driver_sql(f"BEGIN {mode}")


def _engine(db: str) -> sa.Engine:
    """One engine per file, created on first use with its schema, so any call works before reset."""
    path = (data_dir() / db).resolve()
    with _engines_lock:
        engine = _engines.get(path)
        if engine is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            engine = sa.create_engine(f"sqlite:///{path}", connect_args={"timeout": 30})
            sa.event.listen(engine, "connect", _on_connect)
            sa.event.listen(engine, "begin", _on_begin)
            _METADATA[db].create_all(engine)
            _engines[path] = engine
    return engine


@contextmanager
def _reading(db: str) -> Iterator[sa.Connection]:
    """Reads take a deferred BEGIN: they need no write lock and should not queue behind one."""
    with _engine(db).connect() as conn:
        conn.execution_options(sqlite_begin="DEFERRED")
        yield conn


def _rows(db: str, stmt: sa.Select[Any]) -> list[Record]:
    with _reading(db) as conn:
        return [dict(row._mapping) for row in conn.execute(stmt)]


def _first(conn: sa.Connection, table: sa.Table, *where: Any) -> sa.Row[Any] | None:
    return conn.execute(sa.select(table).where(*where)).first()


def dispose_engines() -> None:
    """Close every pooled connection, for test teardown and before handing data to a new process."""
    with _engines_lock:
        engines = list(_engines.values())
        _engines.clear()
    for engine in engines:
        engine.dispose()


def _forget_inherited_engines() -> None:
    """A forked worker must not reuse its parent's SQLite connections, nor close them."""
    global _engines_lock
    _engines_lock = threading.Lock()  # another thread may have held it at the fork
    for engine in _engines.values():
        engine.dispose(close=False)
    _engines.clear()


os.register_at_fork(after_in_child=_forget_inherited_engines)


def _now() -> str:
    return datetime.now(UTC).isoformat()


def reset() -> None:
    """Start the demo from a known world: one order, one open ticket, no faults.

    Rows are deleted rather than files, so a worker that already has the databases open sees
    the fresh world too.
    """
    for db, metadata in _METADATA.items():
        with _engine(db).begin() as conn:
            for table in reversed(metadata.sorted_tables):
                conn.execute(sa.delete(table))
    order = {"customer_email": "ada@example.com", "total_cents": 499900, "currency": "USD"}
    with _engine(BILLING).begin() as conn:
        conn.execute(sa.insert(_orders).values(order_id=4921, **order))
    with _engine(TICKETS).begin() as conn:
        conn.execute(sa.insert(_tickets).values(ticket_id=9104, order_id=4921, status="open"))


# --- fault switches ---------------------------------------------------------------------------


def _switch_db(service: str) -> str:
    try:
        return SERVICES[service]
    except KeyError:
        known = ", ".join(sorted(SERVICES))
        raise ValueError(f"unknown service {service!r}; known services: {known}") from None


def _set_switch(service: str, **values: Any) -> None:
    """Upsert, so setting one switch leaves the service's other switches as they were."""
    db = _switch_db(service)
    table = _SWITCHES[db]
    stmt = sqlite_insert(table).values(service=service, **values)
    stmt = stmt.on_conflict_do_update(index_elements=[table.c.service], set_=values)
    with _engine(db).begin() as conn:
        conn.execute(stmt)


def set_down(service: str, down: bool = True) -> None:
    """Simulate an outage that lasts until it is switched off again."""
    _set_switch(service, down=int(down))


def fail_next(service: str, times: int) -> None:
    """Simulate a flaky service: the next `times` calls fail, then it recovers by itself."""
    if times < 0:
        raise ValueError("times must be >= 0")
    _set_switch(service, fail_next=times)


def set_delay(service: str, seconds: float) -> None:
    """Simulate a slow service, to exercise timeouts and overlapping workers."""
    if seconds < 0:
        raise ValueError("seconds must be >= 0")
    _set_switch(service, delay_seconds=float(seconds))


def clear_switches() -> None:
    """Heal every service at once, whatever state a previous run left behind."""
    for db, table in _SWITCHES.items():
        with _engine(db).begin() as conn:
            conn.execute(sa.delete(table))


def check_service(service: str) -> None:
    """Fail the way a real dependency would, before the operation has any effect at all."""
    db = _switch_db(service)
    table = _SWITCHES[db]
    where = table.c.service == service
    with _reading(db) as conn:
        delay = conn.scalar(sa.select(table.c.delay_seconds).where(where))
    if delay:
        time.sleep(delay)
    error: str | None = None
    with _engine(db).begin() as conn:
        row = conn.execute(sa.select(table.c.down, table.c.fail_next).where(where)).first()
        if row is not None and row.down:
            error = f"{service} is down"
        elif row is not None and row.fail_next > 0:
            left = row.fail_next - 1
            conn.execute(sa.update(table).where(where).values(fail_next=left))
            error = f"{service} failed (injected, {left} left)"
    # Raised after the block so the decrement commits instead of rolling back.
    if error is not None:
        raise ServiceUnavailableError(error)


# --- orders and billing -----------------------------------------------------------------------


def _order_row(conn: sa.Connection, order_id: int) -> sa.Row[Any]:
    row = _first(conn, _orders, _orders.c.order_id == order_id)
    if row is None:
        raise NotFoundError(f"order {order_id} not found")
    return row


def get_order(order_id: int) -> Record:
    """Read an order; the agent looks it up before deciding what to credit."""
    check_service("orders")
    with _reading(BILLING) as conn:
        return dict(_order_row(conn, order_id)._mapping)


def _entry_by_key(conn: sa.Connection, key: str, kind: str) -> sa.Row[Any] | None:
    """A key names one action; reusing a credit's key for a reversal is a caller bug."""
    row = _first(conn, _ledger, _ledger.c.idempotency_key == key)
    if row is not None and row.kind != kind:
        raise ValueError(f"idempotency key {key!r} already used for a {row.kind}")
    return row


def _append_entry(
    conn: sa.Connection, order_id: int, kind: str, amount: int, key: str, **extra: Any
) -> sa.Row[Any]:
    values = {"order_id": order_id, "kind": kind, "amount_cents": amount, "idempotency_key": key}
    stmt = sa.insert(_ledger).values(created_at=_now(), **values, **extra)
    return conn.execute(stmt.returning(_ledger)).one()


def _credit_result(row: sa.Row[Any]) -> Record:
    return {
        "credit_id": f"cr_{row.order_id}_{row.entry_id}",
        "order_id": row.order_id,
        "amount_cents": row.amount_cents,
        "entry_id": row.entry_id,
    }


def _reversal_result(row: sa.Row[Any]) -> Record:
    return {
        "reversal_id": f"rv_{row.order_id}_{row.entry_id}",
        "credit_id": f"cr_{row.order_id}_{row.reverses_entry_id}",
        "amount_cents": row.amount_cents,
        "entry_id": row.entry_id,
    }


def issue_credit(order_id: int, amount_cents: int, idempotency_key: str, memo: str = "") -> Record:
    """Credit a customer; a redelivered call with the same key gets the first credit back."""
    check_service("billing")
    if isinstance(amount_cents, bool) or not isinstance(amount_cents, int) or amount_cents <= 0:
        raise ValueError(f"amount_cents must be a positive integer, got {amount_cents!r}")
    with _engine(BILLING).begin() as conn:
        existing = _entry_by_key(conn, idempotency_key, "credit")
        if existing is not None:
            return _credit_result(existing)
        order = _order_row(conn, order_id)
        if amount_cents > order.total_cents:
            raise CreditRefusedError(
                f"credit {amount_cents} exceeds order total {order.total_cents}"
            )
        row = _append_entry(conn, order_id, "credit", amount_cents, idempotency_key, memo=memo)
        return _credit_result(row)


def _parse_credit_id(credit_id: str) -> tuple[int, int]:
    match = re.fullmatch(r"cr_(\d+)_(\d+)", credit_id)
    if match is None:
        raise NotFoundError(f"credit {credit_id!r} not found (not a credit id)")
    return int(match[1]), int(match[2])


def reverse_credit(credit_id: str, idempotency_key: str) -> Record:
    """Cancel a credit with a new, negative line that points at it, as an accountant would."""
    check_service("reversal")
    order_id, entry_id = _parse_credit_id(credit_id)
    with _engine(BILLING).begin() as conn:
        existing = _entry_by_key(conn, idempotency_key, "reversal")
        if existing is not None:
            return _reversal_result(existing)
        this_credit = (_ledger.c.entry_id == entry_id, _ledger.c.order_id == order_id)
        credit = _first(conn, _ledger, *this_credit, _ledger.c.kind == "credit")
        if credit is None:
            raise NotFoundError(f"credit {credit_id} not found")
        prior = _first(conn, _ledger, _ledger.c.reverses_entry_id == entry_id)
        if prior is not None:
            return _reversal_result(prior)
        memo = f"reversal of {credit_id}"
        amount = -credit.amount_cents
        extra = {"reverses_entry_id": entry_id, "memo": memo}
        row = _append_entry(conn, order_id, "reversal", amount, idempotency_key, **extra)
        return _reversal_result(row)


def ledger(order_id: int | None = None) -> list[Record]:
    """Every line ever written, in order: the audit trail that shows credit and reversal both."""
    stmt = sa.select(_ledger).order_by(_ledger.c.entry_id)
    if order_id is not None:
        stmt = stmt.where(_ledger.c.order_id == order_id)
    return _rows(BILLING, stmt)


# --- tickets ----------------------------------------------------------------------------------


def get_ticket(ticket_id: int) -> Record:
    """Read a ticket without a fault check, so the demo can always show its state."""
    with _reading(TICKETS) as conn:
        row = _first(conn, _tickets, _tickets.c.ticket_id == ticket_id)
    if row is None:
        raise NotFoundError(f"ticket {ticket_id} not found")
    return dict(row._mapping)


def set_ticket_status(ticket_id: int, status: str, idempotency_key: str) -> Record:
    """Change a status and report the one before it, which the saga needs to put it back."""
    check_service("tickets")
    with _engine(TICKETS).begin() as conn:
        keys = _ticket_keys.c
        stored = conn.scalar(sa.select(keys.result).where(keys.idempotency_key == idempotency_key))
        if stored is not None:
            previous_result: Record = json.loads(stored)
            return previous_result
        this_ticket = _tickets.c.ticket_id == ticket_id
        current = conn.scalar(sa.select(_tickets.c.status).where(this_ticket))
        if current is None:
            raise NotFoundError(f"ticket {ticket_id} not found")
        conn.execute(sa.update(_tickets).where(this_ticket).values(status=status))
        applied = {"ticket_id": ticket_id, "idempotency_key": idempotency_key, "at": _now()}
        conn.execute(sa.insert(_history).values(from_status=current, to_status=status, **applied))
        result: Record = {"ticket_id": ticket_id, "previous": current, "status": status}
        conn.execute(sa.insert(_ticket_keys).values(result=json.dumps(result), **applied))
        return result


def renumber_ticket(ticket_id: int, new_id: int) -> None:
    """A helpdesk migration moved the ticket to a new number: an undo that captured the old
    one now fails until someone corrects it."""
    with _engine(TICKETS).begin() as conn:
        this_ticket = _tickets.c.ticket_id == ticket_id
        if conn.execute(sa.update(_tickets).where(this_ticket).values(ticket_id=new_id)).rowcount:
            return
    raise NotFoundError(f"ticket {ticket_id} not found")


def ticket_history(ticket_id: int) -> list[Record]:
    """Every status change, so a restored ticket still shows that it was once changed."""
    stmt = sa.select(_history).where(_history.c.ticket_id == ticket_id).order_by(_history.c.id)
    return _rows(TICKETS, stmt)


# --- outbox -----------------------------------------------------------------------------------


def _enqueue(channel: str, recipient: str, subject: str | None, body: str, key: str) -> sa.Row[Any]:
    """Sent is sent: a repeated key returns the message already queued, never a second copy."""
    with _engine(OUTBOX).begin() as conn:
        row = _first(conn, _outbox, _outbox.c.idempotency_key == key)
        if row is not None:
            if row.channel != channel:
                raise ValueError(f"idempotency key {key!r} already used for {row.channel}")
            return row
        values = {"channel": channel, "recipient": recipient, "subject": subject, "body": body}
        stmt = sa.insert(_outbox).values(idempotency_key=key, at=_now(), **values)
        return conn.execute(stmt.returning(_outbox)).one()


def send_mail(to: str, subject: str, body: str, idempotency_key: str) -> Record:
    """Queue an email; mail cannot be unsent, which is why the saga sends it last."""
    check_service("mail")
    row = _enqueue("mail", to, subject, body, idempotency_key)
    return {"message_id": f"msg_{row.id}", "to": row.recipient, "subject": row.subject}


def post_webhook(url: str, payload: dict[str, Any], idempotency_key: str) -> Record:
    """Queue a webhook delivery; like mail, the far side cannot be made to forget it."""
    check_service("webhook")
    body = json.dumps(payload, sort_keys=True)
    row = _enqueue("webhook", url, None, body, idempotency_key)
    return {"delivery_id": f"wh_{row.id}", "url": row.recipient}


def outbox() -> list[Record]:
    """Everything that left (or would have left) the building, in the order it was queued."""
    return _rows(OUTBOX, sa.select(_outbox).order_by(_outbox.c.id))


def snapshot() -> Record:
    """The final state of all three systems, for the demo to print after a run."""
    return {
        "ledger": ledger(),
        "tickets": _rows(TICKETS, sa.select(_tickets).order_by(_tickets.c.ticket_id)),
        "outbox": outbox(),
    }


# --- lookups by idempotency key (for reconciling a step whose outcome is in doubt) ----------


def credit_by_key(idempotency_key: str) -> Record | None:
    """The credit issued under this key, as ``issue_credit`` returned it, or None."""
    with _reading(BILLING) as conn:
        row = _first(conn, _ledger, _ledger.c.idempotency_key == idempotency_key)
    return _credit_result(row) if row is not None and row.kind == "credit" else None


def status_change_by_key(idempotency_key: str) -> Record | None:
    """The status change applied under this key, as ``set_ticket_status`` returned it."""
    with _reading(TICKETS) as conn:
        keys = _ticket_keys.c
        stored = conn.scalar(sa.select(keys.result).where(keys.idempotency_key == idempotency_key))
    return None if stored is None else dict(json.loads(stored))


def outgoing_by_key(idempotency_key: str) -> Record | None:
    """The mail or webhook queued under this key, or None."""
    with _reading(OUTBOX) as conn:
        row = _first(conn, _outbox, _outbox.c.idempotency_key == idempotency_key)
    if row is None:
        return None
    if row.channel == "mail":
        return {"message_id": f"msg_{row.id}", "to": row.recipient, "subject": row.subject}
    return {"delivery_id": f"wh_{row.id}", "url": row.recipient}


# --- whether an effect is live now (``saga drill`` judges each run by these) ----------------


def credit_live(idempotency_key: str) -> int:
    """1 if the credit issued under this key stands (no reversal points at it), else 0."""
    with _reading(BILLING) as conn:
        row = _first(conn, _ledger, _ledger.c.idempotency_key == idempotency_key)
        if row is None or row.kind != "credit":
            return 0
        reversal = _first(conn, _ledger, _ledger.c.reverses_entry_id == row.entry_id)
    return 0 if reversal is not None else 1


def status_change_live(idempotency_key: str) -> int:
    """1 if the ticket's latest status change is the one made under this key, else 0."""
    with _reading(TICKETS) as conn:
        change = _first(conn, _history, _history.c.idempotency_key == idempotency_key)
        if change is None:
            return 0
        stmt = sa.select(_history.c.idempotency_key).where(_history.c.ticket_id == change.ticket_id)
        latest = conn.scalar(stmt.order_by(_history.c.id.desc()).limit(1))
    return 1 if latest == idempotency_key else 0
