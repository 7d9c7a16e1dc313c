"""The seed's story, for real: a Celery worker, Redis, and three separate systems.

Scenario 1: the mail service is down, so the run unwinds: the ticket status is restored and the
credit is reversed by a new ledger entry. Scenario 2: the reply goes out (the pivot), then the
partner webhook fails, so nothing is unwound and a person gets the whole picture. Scenario 3:
the loop runs on the workers (a threads-pool worker plays the turns); its scripted model asks to
send the reply in the same answer as the credit, is told to wait, and sends it next turn.

Run with ``make demo`` (it provides Redis and stops everything it starts).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import redis
from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.setdefault("SAGA_DEMO_DATA", str(ROOT / ".demo-data")))
os.environ.setdefault("SAGA_DATABASE_URL", f"sqlite:///{DATA / 'saga.db'}")

ORDER, TICKET, EMAIL = 4921, 9104, "ada@example.com"


def agent_calls(run: Any, calls: list[tuple[str, dict[str, Any]]]) -> None:
    """What an agent loop does: call a tool, wait for its result, decide the next."""
    from saga import SagaError

    for tool, args in calls:
        try:
            result = run.call(tool, **args).result(timeout=30)
            print(f"   agent: {tool} → {result}")
        except SagaError as exc:
            print(f"   agent: {tool} ✗ {exc}")
            return


def show_run(saga: Any, picture: Any) -> None:
    """The run's timeline and, if it escalated, its card: what ``saga show`` and
    ``saga escalation show`` print, from the same renderer."""
    from saga.escalations import escalation_package, run_card, run_document, to_rich
    from saga.escalations.invocation import command_for

    console = Console(highlight=False, width=120)
    escalations = saga.records.escalations(picture.run_id, open_only=True)
    for escalation in escalations:  # the card holds the timeline
        package = escalation_package(escalation, picture, command=command_for(saga))
        console.print(to_rich(package), crop=False)
    if not escalations:
        console.print(run_card(run_document(picture)), crop=False)


def scenario(title: str, saga: Any, calls: list[tuple[str, dict[str, Any]]]) -> None:
    from tasks import systems

    print(f"\n== {title} ==")
    run = saga.start_run()
    agent_calls(run, calls)
    picture = run.finish(timeout=30) if run.state().value == "running" else run.wait(timeout=60)
    print()
    show_run(saga, picture)
    print("\n   the three systems now:")
    print("\n".join(render_systems()))
    systems.clear_switches()


def hosted_scenario(saga: Any) -> None:
    """Scenario 3: enqueue a run as a web app would, and print what each turn did."""
    print("\n== Scenario 3: a hosted agent replies too early, is told to wait, and recovers ==")
    run_id = saga.enqueue_run("refund", "Order 4921 arrived late. Refund it and tell Ada.")
    picture = saga.run(run_id).wait(timeout=60)
    from saga.client import status_of

    for turn in status_of(picture).turns:
        print(f"   model, turn {turn['turn']}: " + (turn["text"] or "asks for"))
        for call, result in zip(turn["calls"], turn["results"] or [], strict=False):
            where = f"step {call['step']}" if call["step"] else "refused"
            content = result["content"]
            shown = content.get("error") if result["is_error"] else content
            print(f"      {call['name']} → {where}: {str(shown)[:150]}")
    print()
    show_run(saga, picture)
    print("\n   the three systems now:")
    print("\n".join(render_systems()))


def render_systems() -> list[str]:
    """The three systems as they stand: the ledger (a reversal is a new line), the tickets,
    what was sent."""
    from tasks import systems

    snapshot = systems.snapshot()
    lines = ["   billing ledger:"]
    for entry in snapshot["ledger"]:
        reverses = (
            f" (reverses #{entry['reverses_entry_id']})" if entry["reverses_entry_id"] else ""
        )
        amount = entry["amount_cents"] / 100
        lines.append(f"     #{entry['entry_id']} {entry['kind']:<8} {amount:>+12,.2f}{reverses}")
    if not snapshot["ledger"]:
        lines.append("     (no entries)")
    net = sum(e["amount_cents"] for e in snapshot["ledger"]) / 100
    lines.append(f"     net credited: {net:,.2f}")
    for ticket in snapshot["tickets"]:
        lines.append(f"   ticket {ticket['ticket_id']}: {ticket['status']}")
    outgoing = [f"{m['channel']} to {m['recipient']}" for m in snapshot["outbox"]]
    lines.append(f"   outbox: {', '.join(outgoing) or '(nothing sent)'}")
    return lines


def main() -> int:
    redis_url = os.environ.get("SAGA_REDIS_URL", "redis://localhost:6379")
    try:
        redis.Redis.from_url(redis_url, socket_timeout=2).ping()
    except redis.RedisError as exc:
        print(f"demo: no Redis at {redis_url} ({exc}); run `make demo`, which starts one.")
        return 2
    DATA.mkdir(parents=True, exist_ok=True)

    from saga.testing import WorkerProcess
    from tasks import systems
    from tasks.app import saga

    systems.reset()
    credit = ("issue_credit", {"order_id": ORDER, "amount_cents": 250_000, "memo": "late"})
    forward: list[tuple[str, dict[str, Any]]] = [
        ("get_order", {"order_id": ORDER}),
        credit,
        ("set_ticket_status", {"ticket_id": TICKET, "status": "pending_refund"}),
        ("send_reply", {"to": EMAIL, "subject": "Your credit", "body": "We credited $2,500."}),
    ]
    log = DATA / "worker.log"
    turns_log = DATA / "turn-worker.log"
    print(f"starting a Celery worker (log: {log}) and a turn worker (log: {turns_log})")
    turns = WorkerProcess(
        "tasks.app",
        pool="threads",
        concurrency=10,
        extra_args=["-Q", "saga.turns"],
        logfile=turns_log,
        cwd=ROOT,
    )
    with WorkerProcess("tasks.app", concurrency=2, logfile=log, cwd=ROOT), turns:
        systems.set_down("mail")
        scenario("Scenario 1: the mail service is down", saga, forward)

        systems.reset()
        systems.set_down("webhook")
        webhook = (
            "notify_webhook",
            {"url": "https://crm.example/hooks", "event": {"order": ORDER}},
        )
        scenario("Scenario 2: the reply is sent, then the webhook fails", saga, [*forward, webhook])

        systems.reset()
        hosted_scenario(saga)
    print(f"\nrecords: {os.environ['SAGA_DATABASE_URL']}  (runs and escalations, SQLAlchemy)")
    url = os.environ["SAGA_DATABASE_URL"]
    print(f"look again: SAGA_DATABASE_URL={url} saga runs  (saga show RUN, saga escalations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
