"""Rendering the console's pages: the templates, the links under whatever path the app is
served at, the timeline as HTML (the very lines ``saga show`` draws), the session's cookie."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from markupsafe import Markup, escape

from saga.escalations import RunDoc, timeline
from saga.escalations.questions import unanswered_text
from saga.escalations.timeline import Line
from saga.web.auth import LOGIN_COOKIE, SESSION_COOKIE, Session, context

templates = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))

_STYLES = {"green", "red", "yellow", "cyan", "dim", "bold"}


def base(request: Request) -> str:
    """The path the app is served under ('' standalone, ``/saga`` when mounted there)."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def page(
    request: Request,
    template: str,
    session: Session | None,
    status: int = 200,
    **values: Any,
) -> HTMLResponse:
    values = _with_session(request, session, values)
    return templates.TemplateResponse(request, template, values, status_code=status)


def fragment(request: Request, template: str, session: Session | None, **values: Any) -> str:
    """A part of a page, as the live updates send it."""
    return templates.get_template(template).render(_with_session(request, session, values))


def _with_session(
    request: Request, session: Session | None, values: dict[str, Any]
) -> dict[str, Any]:
    """What every template may use: where links go, who is logged in, what they may do."""
    return {
        **values,
        "request": request,
        "base": base(request),
        "session": session,
        "can_operate": session is not None and session.may_operate,
        "csrf": session.csrf if session is not None else "",
    }


def go(request: Request, path: str) -> RedirectResponse:
    """After a form: see the page it changed (303, so a reload does not post again)."""
    return RedirectResponse(base(request) + path, status_code=303)


def return_path(path: str) -> str:
    """``path`` if it is a page of the console to come back to after logging in, else ''.
    Only a path under ``/console/`` (joined to the app's base, so it stays on this origin):
    no scheme, no ``//`` host, no backslash or control character, not the login itself nor a
    live stream."""
    if not path.startswith("/console/") or len(path) > 1000 or not path.isascii():
        return ""
    if "//" in path or "\\" in path or any(c < " " or c == "\x7f" for c in path):
        return ""
    page = path.split("?", 1)[0].rstrip("/")
    if page in ("/console/login", "/console/logout") or page.endswith("/events"):
        return ""
    return path


def timeline_html(doc: RunDoc) -> Markup:
    """The seed's drawing of the run (forward steps with classes and pushes, the pivot line,
    the unwind with ✓/✗ and attempts, the ending), each styled segment a span."""
    return Markup("\n").join(_line(line) for line in timeline(doc))


def _line(line: Line) -> Markup:
    parts = []
    for text, style in line:
        classes = " ".join(f"t-{s}" for s in style.split() if s in _STYLES)
        parts.append(
            Markup('<span class="{}">{}</span>').format(classes, text) if classes else escape(text)
        )
    return Markup("").join(parts)


def pretty(value: Any) -> str:
    """A JSON value as a person reads it in a cell."""
    return json.dumps(value, ensure_ascii=False, indent=None, default=str)


templates.env.filters["pretty"] = pretty
#: A question that expired unanswered, as the card and the Markdown say it.
templates.env.filters["unanswered"] = unanswered_text


def cookie_path(request: Request) -> str:
    return base(request) + "/console"


def set_session_cookie(request: Request, response: Response, session_id: str) -> None:
    settings = context(request).settings
    response.set_cookie(
        SESSION_COOKIE,
        session_id,
        max_age=settings.session_seconds,
        path=cookie_path(request),
        secure=settings.secure_cookies,
        httponly=True,
        samesite="strict",
    )


def set_login_cookie(request: Request, response: Response, value: str) -> None:
    settings = context(request).settings
    response.set_cookie(
        LOGIN_COOKIE,
        value,
        max_age=3600,
        path=cookie_path(request),
        secure=settings.secure_cookies,
        httponly=True,
        samesite="strict",
    )


def clear_cookies(request: Request, response: Response) -> None:
    for name in (SESSION_COOKIE, LOGIN_COOKIE):
        response.delete_cookie(name, path=cookie_path(request))
