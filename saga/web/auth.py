"""Who is asking: a bearer token on the API, a login session on the console.

API: ``Authorization: Bearer saga_...`` on every route but health. No token → 401, a token
whose scope does not allow the route → 403 (``read`` only reads; ``operate`` may also act).
The token is checked against the records on every request, so a revoke holds at once.

Console: the login form takes a token and opens a session kept in Redis (the cookie holds a
random session id, never the token: ``Secure``, ``HttpOnly``, ``SameSite=Strict``). The
session carries a CSRF token every form posts back; each request checks the token behind the
session is still live. Logging in is protected the same way, by a login-only cookie.
"""

from __future__ import annotations

import hmac
import json
import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from saga.constants import WEB_SESSION_PREFIX
from saga.web import tokens
from saga.web.context import WebContext
from saga.web.tokens import Scope, TokenInfo

SESSION_COOKIE = "saga_session"
LOGIN_COOKIE = "saga_login"


def context(request: Request) -> WebContext:
    ctx: WebContext = request.app.state.saga
    return ctx


Context = Annotated[WebContext, Depends(context)]


def bearer(request: Request, ctx: Context) -> TokenInfo:
    """The token's holder; 401 without a valid, live token."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise HTTPException(
            401,
            "a bearer token is needed: Authorization: Bearer saga_... (`saga tokens create`)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    holder = tokens.verify(ctx.records, token.strip())
    if holder is None:
        raise HTTPException(
            401,
            "the token is unknown or revoked",
            headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
        )
    return holder


def operator(holder: Annotated[TokenInfo, Depends(bearer)]) -> TokenInfo:
    """The token's holder, if its scope may act on runs; 403 for a ``read`` token."""
    if not holder.may_operate:
        raise HTTPException(403, f"token {holder.name!r} may only read (scope {holder.scope})")
    return holder


Reader = Annotated[TokenInfo, Depends(bearer)]
Operator = Annotated[TokenInfo, Depends(operator)]


# -- console sessions ------------------------------------------------------------------------


@dataclass(frozen=True)
class Session:
    session_id: str
    holder: TokenInfo
    csrf: str

    @property
    def may_operate(self) -> bool:
        return self.holder.may_operate


def open_session(ctx: WebContext, token: str) -> tuple[str, Session] | None:
    """A new session for a valid token: its id (the cookie) and what it holds."""
    holder = tokens.verify(ctx.records, token)
    if holder is None:
        return None
    session_id = secrets.token_urlsafe(32)
    csrf = secrets.token_urlsafe(32)
    value = json.dumps({"token_id": holder.token_id, "csrf": csrf})
    ctx.store.client.set(WEB_SESSION_PREFIX + session_id, value, ex=ctx.settings.session_seconds)
    return session_id, Session(session_id, holder, csrf)


def find_session(ctx: WebContext, request: Request) -> Session | None:
    """The request's session, if its cookie names one and its token is still live."""
    session_id = request.cookies.get(SESSION_COOKIE, "")
    if not session_id or len(session_id) > 100:
        return None
    raw = ctx.store.client.get(WEB_SESSION_PREFIX + session_id)
    if raw is None:
        return None
    stored = json.loads(raw)
    holder = tokens.live(ctx.records, str(stored["token_id"]))
    if holder is None:
        close_session(ctx, session_id)
        return None
    return Session(session_id, holder, str(stored["csrf"]))


def close_session(ctx: WebContext, session_id: str) -> None:
    ctx.store.client.delete(WEB_SESSION_PREFIX + session_id)


def csrf_matches(expected: str, given: str | None) -> bool:
    return bool(given) and hmac.compare_digest(expected.encode(), str(given).encode())


def may(session: Session, scope: Scope) -> bool:
    return scope is Scope.READ or session.may_operate
