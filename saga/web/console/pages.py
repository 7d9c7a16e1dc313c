"""The console's pages: log in, the runs and escalations lists, a run, an escalation. Server
rendered, usable without JavaScript; the run page updates itself while the run is live
(``live.py``). Forms (``forms.py``) act; these only read.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.datastructures import URL

from saga.errors import MessageNotSentError, UnknownEscalationError, UnknownRunError
from saga.listing import RunFilter, page_of_runs
from saga.model import RunState
from saga.queries import escalation_rows, hosted_doc
from saga.web import actions, problems
from saga.web.api.common import EscalationId, RunId
from saga.web.auth import SESSION_COOKIE, Session, context, find_session, mint_login_value
from saga.web.console import render

router = APIRouter(prefix="/console", include_in_schema=False)

Handler = Callable[[Request, Exception], Awaitable[Response]]


#: What the login page may say, by the code in its ``?error=``: never text from the link.
LOGIN_ERRORS = {
    "token": "That token is unknown or revoked.",
    "expired": "Your session ended (logged out, expired or its token revoked): log in again.",
}


def viewer(request: Request) -> Session:
    """The logged-in session; a page without one sends the browser to the login form, which
    brings it back here after logging in (``next``)."""
    session = find_session(context(request), request)
    if session is None:
        raise HTTPException(303, "log in", headers={"Location": _login(request)})
    return session


def _login(request: Request) -> str:
    """The login form, saying why when the browser had a session that no longer holds, and
    where to come back to for a page (a form's post is not repeated)."""
    login = URL(render.base(request) + "/console/login")
    if request.cookies.get(SESSION_COOKIE):
        login = login.include_query_params(error="expired")
    here = request.url.path[len(render.base(request)) :]
    if request.url.query:
        here += "?" + request.url.query
    back = render.return_path(here) if request.method == "GET" else ""
    return str(login.include_query_params(next=back) if back else login)


@router.get("")
@router.get("/")
def home(request: Request) -> Response:
    return render.go(request, "/console/runs")


@router.get("/login")
def login_form(request: Request, error: str = "", next: str = "") -> HTMLResponse:
    """The login form. Its CSRF value is minted and signed here, each time (never taken from
    an incoming cookie), and also set as a login-only cookie."""
    value = mint_login_value(context(request))
    response = render.page(
        request,
        "login.html",
        None,
        login_csrf=value,
        error=LOGIN_ERRORS.get(error, "Log in again." if error else ""),
        next=render.return_path(next),
    )
    render.set_login_cookie(request, response, value)
    return response


@router.get("/runs")
def runs(
    request: Request,
    state: Annotated[list[RunState] | None, Query()] = None,
    agent: Annotated[str | None, Query(max_length=200)] = None,
    since: Annotated[str | None, Query(max_length=40)] = None,
    until: Annotated[str | None, Query(max_length=40)] = None,
    escalated: Annotated[str | None, Query(max_length=5)] = None,
    cursor: Annotated[str | None, Query(max_length=400)] = None,
) -> HTMLResponse:
    session = viewer(request)
    ctx = context(request)
    where = RunFilter(
        states=tuple(s.value for s in state or ()),
        agent=agent or None,
        since=_moment(since, "since"),
        until=_moment(until, "until"),
        escalated={"yes": True, "no": False}.get(escalated or ""),
        limit=50,
    )
    listed = page_of_runs(ctx.store, ctx.records, where, cursor or None)
    filters = {
        "state": [s.value for s in state or ()],
        "agent": agent or "",
        "since": since or "",
        "until": until or "",
        "escalated": escalated or "",
    }
    query = [(k, v) for k, values in filters.items() for v in _many(values) if v]
    return render.page(
        request,
        "runs.html",
        session,
        rows=listed.rows,
        next_cursor=listed.next_cursor,
        filters=filters,
        states=[s.value for s in RunState],
        query=query,
    )


def _yes(value: str | None, field: str) -> bool:
    """A checkbox or flag in a query string: absent, ``0``/``false``/``no``/``off``, or
    ``1``/``true``/``yes``/``on`` (what a checked box sends)."""
    text = (value or "").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise HTTPException(422, f"{field}: {value!r} is not yes or no (1/0, true/false, on/off)")


def _many(value: Any) -> list[str]:
    return value if isinstance(value, list) else [value]


def _moment(text: str | None, field: str) -> float | None:
    if not text:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise HTTPException(422, f"{field}: {text!r} is not a date (YYYY-MM-DD or ISO)") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


@router.get("/runs/{run_id}")
def run_page(request: Request, run_id: RunId) -> HTMLResponse:
    session = viewer(request)
    values = run_values(request, run_id)
    return render.page(request, "run.html", session, **values)


def run_values(request: Request, run_id: str) -> dict[str, Any]:
    """What the run page (and each live update of it) shows."""
    ctx = context(request)
    doc = actions.the_run_doc(ctx, run_id)
    hosted = hosted_doc(ctx.store, ctx.records, run_id)
    escalations = ctx.records.escalations(run_id, open_only=True)
    pending, resolution = "", None
    if doc["state"] == "escalated" and not escalations:
        live = ctx.store.picture(run_id)
        # Not recorded yet, and not closed by a person either (a kept effect's decision
        # resolves the run's escalation as it ends: it is not open, whatever the records say).
        if live is not None and live.resolution is None:
            pending = f"{run_id}:{live.generation}"
        elif live is not None and live.resolution is not None:
            resolution = {"escalation_id": f"{run_id}:{live.generation}", **live.resolution}
    return {
        "doc": doc,
        "timeline": render.timeline_html(doc),
        "hosted": hosted,
        "approvals": (hosted or {}).get("pending_approvals", [])
        if doc["state"] == "running"
        else [],
        "escalation": escalations[-1].escalation_id if escalations else pending,
        "resolution": resolution,
        "live_run": doc["state"] in ("running", "unwinding"),
    }


#: Escalations the console's list shows, newest first.
_ESCALATIONS_SHOWN = 200


@router.get("/escalations")
def escalations(
    request: Request,
    all: Annotated[str | None, Query(max_length=5)] = None,
    run_id: Annotated[str | None, Query(max_length=128)] = None,
    since: Annotated[str | None, Query(max_length=40)] = None,
) -> HTMLResponse:
    session = viewer(request)
    everything = _yes(all, "all")
    rows = escalation_rows(
        context(request).records,
        open_only=not everything,
        run_id=run_id or None,
        since=_moment(since, "since"),
        limit=_ESCALATIONS_SHOWN,
    )
    return render.page(
        request,
        "escalations.html",
        session,
        rows=rows,
        everything=everything,
        run_id=run_id or "",
        since=since or "",
    )


@router.get("/approvals")
def approvals(request: Request) -> HTMLResponse:
    """What awaits a person across the runs: calls to approve (running hosted runs) and
    effects whose reversal a person decides (unwinding runs); each answered on its run's page."""
    session = viewer(request)
    pending = actions.pending_approvals(context(request))
    reversals = actions.waiting_reversals(context(request))
    return render.page(request, "approvals.html", session, approvals=pending, reversals=reversals)


@router.get("/escalations/{escalation_id}")
def escalation_page(request: Request, escalation_id: EscalationId) -> HTMLResponse:
    session = viewer(request)
    doc = actions.the_escalation(context(request), escalation_id)
    return render.page(
        request,
        "escalation.html",
        session,
        doc=doc,
        timeline=render.timeline_html(doc["run"]),
        app_configured=bool(context(request).settings.app) or context(request)._saga is not None,
    )


# -- errors ------------------------------------------------------------------------------


def or_page(handler: Handler) -> Handler:
    """The API's error handler, or for a console path an HTML page saying the same."""

    async def handle(request: Request, exc: Exception) -> Response:
        path = request.url.path[len(render.base(request)) :]
        if not path.startswith("/console"):
            return await handler(request, exc)
        if isinstance(exc, HTTPException) and exc.status_code == 303:
            location = (exc.headers or {}).get("Location", render.base(request) + "/console/login")
            return RedirectResponse(location, status_code=303)
        answer = await handler(request, exc)
        assert isinstance(answer, JSONResponse)
        status = answer.status_code
        if isinstance(exc, UnknownRunError | UnknownEscalationError):
            status = 404
        message = problems.message_of(exc) if not isinstance(exc, HTTPException) else exc.detail
        session = find_session(context(request), request) if status != 503 else None
        if isinstance(exc, MessageNotSentError):
            # Applied, its message not sent: no refusal, and the page must not say one.
            return render.page(
                request,
                "error.html",
                session,
                status=status,
                status_code="Applied",
                heading="Applied: its message is not sent yet",
                message=str(message),
                run_link=f"{render.base(request)}/console/runs/{exc.run_id}",
            )
        return render.page(
            request, "error.html", session, status=status, status_code=status, message=str(message)
        )

    return handle
