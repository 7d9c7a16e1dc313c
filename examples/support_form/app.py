"""A support form that hands a refund to the hosted ``refund`` agent and shows how it goes.

The web app holds no tool code and no agent: it talks to the workers through ``saga.client``
alone (the broker's and Redis's URLs, from ``SAGA_BROKER_URL`` / ``SAGA_REDIS_URL``), so it
can be deployed, restarted and scaled apart from them. A request never waits for the agent:
the form enqueues the run and redirects to its page, which reloads itself while the run goes
on and stops reloading once it ends or waits for a person.

    flask --app examples/support_form/app.py run      # next to the two workers
"""

from __future__ import annotations

import os
from typing import Any

from flask import Flask, abort, jsonify, redirect, render_template, request, url_for
from werkzeug.wrappers import Response

from saga.client import Client, RunStatus
from saga.errors import ApprovalError, UnknownRunError

#: States in which a run will not move any more (its page stops reloading).
ENDED = ("completed", "compensated", "escalated")


def create_app(client: Client | None = None, agent: str | None = None) -> Flask:
    """The app; ``client`` (default: from the environment) and the agent runs are given to
    (default ``SUPPORT_AGENT`` or ``refund``) are parameters so a test can choose them."""
    app = Flask(__name__)
    app.config["AGENT"] = agent or os.environ.get("SUPPORT_AGENT", "refund")
    saga = client or Client()

    def status_or_404(run_id: str) -> RunStatus:
        try:
            return saga.get_run(run_id)
        except UnknownRunError:  # never started, or expired with its retention
            abort(404, f"no run {run_id}")

    @app.get("/")
    def form() -> str:
        return render_template("form.html", agent=app.config["AGENT"])

    @app.post("/runs")
    def start() -> Response:
        order = request.form.get("order", "").strip()
        message = request.form.get("message", "").strip()
        if not order.isdigit() or not message:
            abort(400, "an order number and a message are needed")
        # The model reads this text; the run id comes back at once and names the page.
        text = f"Order {order}, from {request.form.get('email', 'unknown')}: {message}"
        run_id = saga.enqueue_run(app.config["AGENT"], text)
        return redirect(url_for("progress", run_id=run_id), 303)

    @app.get("/runs/<run_id>")
    def progress(run_id: str) -> str:
        status = status_or_404(run_id)
        # Reload while the run moves on by itself; not while it waits for a person, whose
        # typing a reload would wipe.
        live = status.state not in ENDED and not status.awaiting_approval
        return render_template("run.html", run=status, live=live)

    @app.get("/runs/<run_id>.json")
    def progress_json(run_id: str) -> Response:
        return jsonify(status_or_404(run_id).to_dict())

    @app.post("/runs/<run_id>/decision")
    def decide(run_id: str) -> Response | tuple[str, int]:
        form = request.form
        who = form.get("by", "").strip()
        if not who:
            abort(400, "say who decides")
        try:
            if form.get("decision") == "approve":
                saga.approve(run_id, form["approval_id"], args_hash=form["args_hash"], by=who)
            else:
                reason = form.get("reason", "").strip() or "declined"
                saga.deny(run_id, form["approval_id"], reason, args_hash=form["args_hash"], by=who)
        except ApprovalError as exc:  # decided already, expired, or the arguments changed
            return f"not recorded: {exc}", 409
        return redirect(url_for("progress", run_id=run_id), 303)

    @app.template_filter("brief")
    def brief(value: Any) -> str:
        """Arguments and results, short enough for a table cell."""
        text = value if isinstance(value, str) else repr(value)
        return text if len(text) <= 160 else text[:157] + "..."

    return app


app = create_app()  # for `flask --app examples/support_form/app.py run`
