"""The DBOS Transact side of ``benchmarks/peers.py``: the same four steps (``benchmarks.steps``)
as one DBOS workflow, each a ``@DBOS.step``; on the failing path the workflow's except block
runs the same two compensations, newest first, each a step too.

Runs in its own virtualenv (``.venv-peers``, from ``benchmarks/peers-requirements.txt``): saga
never depends on DBOS. ``peers.py`` starts it once per database and drives it over stdin and
stdout, one JSON line per request, metering this process's CPU from outside.

Requests: ``{"op": "round", "fail": bool, "runs": N, "inflight": K}`` answers runs/s;
``{"op": "solo", "fail": bool, "runs": N}`` answers each run's milliseconds; ``{"op": "pids"}``
answers nothing useful but this process's pid; ``{"op": "stop"}`` ends it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dbos import DBOS, DBOSConfig

from benchmarks import steps


@DBOS.step()
def get_order(order_id: int) -> dict[str, Any]:
    return steps.get_order(order_id)


@DBOS.step()
def issue_credit(order_id: int, amount_cents: int, key: str) -> dict[str, Any]:
    return steps.issue_credit(order_id, amount_cents, key)


@DBOS.step()
def set_ticket_status(ticket_id: int, status: str, key: str) -> dict[str, Any]:
    return steps.set_ticket_status(ticket_id, status, key)


@DBOS.step()
def send_reply(to: str, key: str) -> dict[str, Any]:
    return steps.send_reply(to, key)


@DBOS.step(retries_allowed=False)
def send_reply_bounced(to: str, key: str) -> None:
    steps.bounce(to, key)


@DBOS.step()
def restore_status(ticket_id: int, status: str, key: str) -> dict[str, Any]:
    return steps.restore_status(ticket_id, status, key)


@DBOS.step()
def reverse_credit(credit_id: str, key: str) -> dict[str, Any]:
    return steps.reverse_credit(credit_id, key)


@DBOS.workflow()
def refund(key: str, status: str, fail: bool) -> str:
    order = get_order(steps.ORDER)
    credit = issue_credit(order["order_id"], steps.AMOUNT_CENTS, key)
    ticket = set_ticket_status(steps.TICKET, status, key)
    try:
        if fail:
            send_reply_bounced(order["customer_email"], key)
        else:
            send_reply(order["customer_email"], key)
    except steps.BouncedError:
        restore_status(ticket["ticket_id"], ticket["previous"], key)
        reverse_credit(credit["credit_id"], key)
        return "compensated"
    return "completed"


def one(i: int, fail: bool) -> None:
    outcome = refund(f"dbos-{uuid.uuid4().hex}", steps.STATUSES[i % 2], fail)
    if outcome != ("compensated" if fail else "completed"):
        raise RuntimeError(f"workflow ended {outcome}")


def serve(pool: ThreadPoolExecutor) -> None:
    for line in sys.stdin:
        request = json.loads(line)
        answer: dict[str, Any] = {}
        if request["op"] == "stop":
            break
        if request["op"] == "round":
            runs, fail = int(request["runs"]), bool(request["fail"])
            start = time.perf_counter()
            for future in [pool.submit(one, i, fail) for i in range(runs)]:
                future.result(timeout=120)
            answer["rate"] = runs / (time.perf_counter() - start)
        elif request["op"] == "solo":
            times = []
            for i in range(int(request["runs"])):
                start = time.perf_counter()
                one(i, bool(request["fail"]))
                times.append((time.perf_counter() - start) * 1000)
            answer["ms"] = times
        print(json.dumps(answer), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--inflight", type=int, default=8)
    args = parser.parse_args()
    config: DBOSConfig = {
        "name": "saga-peers",
        "system_database_url": args.database_url,
        "log_level": "WARNING",
        "sys_db_pool_size": args.inflight + 4,
    }
    DBOS(config=config)
    DBOS.launch()
    with ThreadPoolExecutor(max_workers=args.inflight) as pool:
        print(json.dumps({"ready": True}), flush=True)
        serve(pool)
    DBOS.destroy()


if __name__ == "__main__":
    main()
