"""The console's forms: log in and out, abort, approve or deny a call, answer whether to
reverse a costly effect (reverse, keep with a note, later), requeue (with a preview of the
corrections as a diff) and resolve. Every form carries the session's CSRF token; one
without it, or posted by a ``read`` login, is refused (403) before anything happens. Each acts
through ``saga.web.actions``, as the API does, with the token's name as ``by``.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, Response
from starlette.datastructures import URL, FormData

from saga.validation import parse_escalation_id
from saga.web import actions
from saga.web.api.common import ApprovalId, EscalationId, RunId
from saga.web.auth import (
    LOGIN_COOKIE,
    Session,
    close_session,
    context,
    csrf_matches,
    find_session,
    from_own_origin,
    log_refusal,
    login_value_ok,
    open_session,
)
from saga.web.console import render
from saga.web.console.pages import viewer

router = APIRouter(prefix="/console", include_in_schema=False)

_TEXT_LIMIT = 2000
_OTHER_ORIGIN = "the form was posted from another origin (Sec-Fetch-Site)"
#: Hosts browsers keep ``Secure`` cookies for over plain http.
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]", "::1")


async def acting(request: Request) -> tuple[Session, FormData]:
    """The session behind a form that changes something: logged in, the form's CSRF token
    matching, and a scope that may act."""
    session = viewer(request)
    form = await request.form()
    if not from_own_origin(request):
        raise HTTPException(403, _OTHER_ORIGIN + ": nothing was done")
    if not csrf_matches(session.csrf, _text(form, "csrf", required=False)):
        raise HTTPException(403, "the form's CSRF token is missing or wrong: nothing was done")
    if not session.may_operate:
        raise HTTPException(403, f"{session.holder.name!r} may only read: nothing was done")
    return session, form


def _text(form: FormData, field: str, *, required: bool = True, limit: int = _TEXT_LIMIT) -> str:
    value = form.get(field)
    text = value.strip() if isinstance(value, str) else ""
    if required and not text:
        raise HTTPException(422, f"{field}: required")
    if len(text) > limit:
        raise HTTPException(422, f"{field}: at most {limit} characters")
    return text


@router.post("/login")
async def login(request: Request) -> Response:
    """Open a session for a token. The login cookie must be a value this server minted and
    the form must repeat it, posted from this origin: so neither a page on another port of
    this host (which can plant cookies here) nor another site can log the browser in as
    someone else."""
    form = await request.form()
    ctx = context(request)
    expected = request.cookies.get(LOGIN_COOKIE, "")
    if not expected:
        raise HTTPException(403, _no_login_cookie(request))
    if not from_own_origin(request):
        raise HTTPException(403, _OTHER_ORIGIN)
    given = _text(form, "csrf", required=False)
    if not (login_value_ok(ctx, expected) and csrf_matches(expected, given)):
        raise HTTPException(403, "the login form's CSRF token is missing or wrong: reload it")
    back = render.return_path(_text(form, "next", required=False, limit=1000))
    opened = open_session(ctx, _text(form, "token", required=False, limit=200))
    if opened is None:
        log_refusal(request, "a console login with an unknown or revoked token")
        again = URL("/console/login").include_query_params(error="token")
        return render.go(request, str(again.include_query_params(next=back) if back else again))
    secret, _ = opened
    response = render.go(request, back or "/console/runs")
    render.set_session_cookie(request, response, secret)
    return response


def _no_login_cookie(request: Request) -> str:
    """Why the login cookie did not come back, pointing at the setting when it is the usual
    cause: ``Secure`` cookies (the default) on a page served over plain http."""
    host = (request.url.hostname or "").lower()
    plain = request.url.scheme == "http" and host not in _LOCAL_HOSTS
    if plain and context(request).settings.secure_cookies:
        return (
            "the browser did not send the login cookie back: the console's cookies are "
            f"Secure (SAGA_API_SECURE_COOKIES=1) and this page is plain http://{host}. "
            "Serve the console over HTTPS, or set SAGA_API_SECURE_COOKIES=0 (a trusted "
            "network only)"
        )
    return "the login form's cookie is missing (are cookies on?): reload the login form"


@router.post("/logout")
async def logout(request: Request) -> Response:
    session = find_session(context(request), request)
    form = await request.form()
    if session is not None:
        if not from_own_origin(request):
            raise HTTPException(403, _OTHER_ORIGIN)
        if not csrf_matches(session.csrf, _text(form, "csrf", required=False)):
            raise HTTPException(403, "the form's CSRF token is missing or wrong")
        close_session(context(request), session)
    response = render.go(request, "/console/login")
    render.clear_cookies(request, response)
    return response


@router.post("/runs/{run_id}/abort")
async def abort(request: Request, run_id: RunId) -> Response:
    session, form = await acting(request)
    reason = _text(form, "reason", required=False) or "aborted by an operator"
    actions.abort(context(request), run_id, reason, session.holder.name)
    return render.go(request, f"/console/runs/{run_id}")


@router.post("/runs/{run_id}/approvals/{approval_id}/{verdict}")
async def decide(
    request: Request, run_id: RunId, approval_id: ApprovalId, verdict: str
) -> Response:
    if verdict not in ("approve", "deny"):
        raise HTTPException(404, f"no such decision {verdict[:20]!r}")
    session, form = await acting(request)
    args_hash = _text(form, "args_hash", limit=64)
    reason = _text(form, "reason") if verdict == "deny" else ""
    actions.decide(
        context(request),
        run_id,
        approval_id,
        approve=verdict == "approve",
        args_hash=args_hash,
        reason=reason,
        by=session.holder.name,
    )
    return render.go(request, f"/console/runs/{run_id}")


#: What a person may answer when an undo's reversal policy asks (``saga.operations``).
_REVERSAL_DECISIONS = ("reverse", "keep", "later")


@router.post("/runs/{run_id}/reversals/{step}/{decision}")
async def decide_reversal(request: Request, run_id: RunId, step: int, decision: str) -> Response:
    """Reverse the effect now, keep it (the note, required, says why for the books) or
    decide later: bound to the hash of the undo the page showed, taken once. A stale hash
    (the undo changed, or another person answered first) is refused on the error page."""
    if decision not in _REVERSAL_DECISIONS:
        raise HTTPException(404, f"no such decision {decision[:20]!r}")
    session, form = await acting(request)
    args_hash = _text(form, "args_hash", limit=64)
    note = _text(form, "note", required=decision == "keep")
    actions.decide_reversal(
        context(request),
        run_id,
        step,
        decision,
        args_hash=args_hash,
        note=note,
        by=session.holder.name,
    )
    return render.go(request, f"/console/runs/{run_id}")


@router.post("/escalations/{escalation_id}/requeue/preview")
async def requeue_preview(request: Request, escalation_id: EscalationId) -> HTMLResponse:
    """The corrections typed into the escalation page, as a diff to confirm."""
    session, form = await acting(request)
    doc = actions.the_escalation(context(request), escalation_id)
    originals: dict[int, dict[str, Any]] = {
        c["step"]: dict(c["undo"]["args"]) if c["undo"] else {} for c in doc["failed_compensations"]
    }
    corrections: dict[str, dict[str, Any]] = {}
    diff = []
    for key, raw in form.multi_items():
        if not key.startswith("fix.") or not isinstance(raw, str):
            continue
        step_text, _, arg = key.removeprefix("fix.").partition(".")
        # isdecimal, ASCII: str.isdigit also takes "²", which int() refuses.
        step = int(step_text) if step_text.isascii() and step_text.isdecimal() else -1
        if step not in originals or arg not in originals[step]:
            raise HTTPException(422, f"{key[:100]}: no such argument of a failed undo")
        before, after = originals[step][arg], _value(raw)
        if after != before:
            corrections.setdefault(str(step), {})[arg] = after
            diff.append({"step": step, "arg": arg, "before": before, "after": after})
    return render.page(
        request,
        "requeue.html",
        session,
        doc=doc,
        diff=diff,
        corrections=json.dumps(corrections, ensure_ascii=False),
    )


def _value(text: str) -> Any:
    """What an argument box says: JSON when it parses as JSON (``100``, ``true``, ``"x"``),
    else the text as it is (as ``saga requeue --set`` reads a value)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


@router.post("/escalations/{escalation_id}/requeue")
async def requeue(request: Request, escalation_id: EscalationId) -> Response:
    session, form = await acting(request)
    try:
        raw = json.loads(_text(form, "corrections", required=False, limit=64_000) or "{}")
        corrections = {int(step): dict(fix) for step, fix in raw.items()}
    except (ValueError, TypeError, AttributeError):
        raise HTTPException(422, "corrections: not step -> {argument: value}") from None
    actions.requeue(context(request), escalation_id, corrections, session.holder.name)
    return render.go(request, f"/console/runs/{parse_escalation_id(escalation_id)[0]}")


@router.post("/escalations/{escalation_id}/resolve")
async def resolve(request: Request, escalation_id: EscalationId) -> Response:
    session, form = await acting(request)
    actions.resolve(context(request), escalation_id, _text(form, "note"), session.holder.name)
    return render.go(request, f"/console/escalations/{escalation_id}")
