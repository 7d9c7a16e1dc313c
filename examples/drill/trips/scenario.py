"""The booking as a driven run: what ``saga drill --scenario trips.scenario:book_trip`` plays."""

from __future__ import annotations

from typing import Any


def book_trip(run: Any) -> None:
    run.call("hold_seat", flight="LH-400").result(timeout=30)
    run.call("charge_card", order_id="o-7", amount_cents=20_000).result(timeout=30)
    run.call("charge_card", order_id="o-7", amount_cents=80_000).result(timeout=30)
    run.call("send_ticket", order_id="o-7", email="ada@example.com").result(timeout=30)
    run.finish(timeout=30)
