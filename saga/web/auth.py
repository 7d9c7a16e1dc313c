"""Who is asking: a bearer token on the API, a login session on the console.

API: ``Authorization: Bearer saga_...`` on every route but health. No token → 401, a token
whose scope does not allow the route → 403 (``read`` only reads; ``operate`` may also act).
The token is checked against the records on every request, so a revoke holds at once.

Console: the login form takes a token and opens a session kept in Redis. The cookie holds a
random secret (never the token: ``Secure``, ``HttpOnly``, ``SameSite=Strict``); Redis keeps
the session under the secret's SHA-256, with the token's id, and the CSRF token every form
posts back is an HMAC of the secret: whoever can read Redis (a read-only user, an RDB or AOF
copy) finds nothing to put in a cookie or a form. Each request, and each tick of a live
stream, checks the session still exists and the token behind it is still live. One token
holds at most ``sessions_per_token`` sessions (the oldest ends).

Logging in is protected by a login-only cookie whose value the server signs (it never adopts
one it did not mint) and, on every console form, by the browser's ``Sec-Fetch-Site``: a post
from another origin of the same site (another port of this host, where a cookie can be
planted) is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Annotated

import redis
from fastapi import Depends, HTTPException, Request

from saga.constants import WEB_LOGIN_KEY, WEB_SESSION_PREFIX, WEB_TOKEN_SESSIONS_PREFIX
from saga.web import tokens
from saga.web.context import WebContext
from saga.web.tokens import Scope, TokenInfo

SESSION_COOKIE = "saga_session"
LOGIN_COOKIE = "saga_login"
#: Seconds a login form's CSRF value is good for.
LOGIN_SECONDS = 3600
#: What a browser says of a form post from this very origin (or typed in by hand).
_OWN_ORIGIN = ("same-origin", "none")

logger = logging.getLogger("saga.web")


def context(request: Request) -> WebContext:
    ctx: WebContext = request.app.state.saga
    return ctx


Context = Annotated[WebContext, Depends(context)]


def bearer(request: Request, ctx: Context) -> TokenInfo:
    """The token's holder; 401 without a valid, live token."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        log_refusal(request, "no bearer token")
        raise HTTPException(
            401,
            "a bearer token is needed: Authorization: Bearer saga_... (`saga tokens create`)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    holder = tokens.verify(ctx.records, token.strip())
    if holder is None:
        log_refusal(request, "an unknown or revoked token")
        raise HTTPException(
            401,
            "the token is unknown or revoked",
            headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
        )
    return holder


def log_refusal(request: Request, why: str) -> None:
    """A line for each refusal, so attempts show in the log (never the token's text)."""
    peer = request.client.host if request.client else "?"
    logger.warning("refused %s %s from %s: %s", request.method, request.url.path, peer, why)


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
    #: The SHA-256 of the cookie's secret: the session's name in Redis.
    digest: str
    holder: TokenInfo
    csrf: str

    @property
    def may_operate(self) -> bool:
        return self.holder.may_operate

    @property
    def key(self) -> str:
        return WEB_SESSION_PREFIX + self.digest


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _csrf(secret: str) -> str:
    """The session's CSRF token, derived from the cookie's secret so Redis never holds it."""
    return hmac.new(secret.encode(), b"saga console csrf", hashlib.sha256).hexdigest()


def open_session(ctx: WebContext, token: str) -> tuple[str, Session] | None:
    """A new session for a valid token: the cookie's secret and what the session holds. The
    token's oldest sessions beyond ``sessions_per_token`` end."""
    holder = tokens.verify(ctx.records, token)
    if holder is None:
        return None
    secret = secrets.token_urlsafe(32)
    session = Session(_digest(secret), holder, _csrf(secret))
    seconds, now = ctx.settings.session_seconds, time.time()
    index = WEB_TOKEN_SESSIONS_PREFIX + holder.token_id
    value = json.dumps({"token_id": holder.token_id, "opened": now})
    with ctx.store.client.pipeline(transaction=_together(ctx)) as pipe:
        pipe.set(session.key, value, ex=seconds)
        pipe.zadd(index, {session.digest: now})
        pipe.zremrangebyscore(index, "-inf", now - seconds)
        pipe.expire(index, seconds)
        pipe.zrange(index, 0, -ctx.settings.sessions_per_token - 1)
        *_, evicted = pipe.execute()
    if evicted:
        with ctx.store.client.pipeline(transaction=_together(ctx)) as pipe:
            for digest in evicted:  # (one key a command: on a cluster, each has its slot)
                pipe.delete(WEB_SESSION_PREFIX + digest)
            pipe.zrem(index, *evicted)
            pipe.execute()
    return secret, session


def find_session(ctx: WebContext, request: Request) -> Session | None:
    """The request's session, if its cookie names one and its token is still live."""
    secret = request.cookies.get(SESSION_COOKIE, "")
    if not secret or len(secret) > 100:
        return None
    digest = _digest(secret)
    raw = ctx.store.client.get(WEB_SESSION_PREFIX + digest)
    if raw is None:
        return None
    token_id = str(json.loads(raw)["token_id"])
    holder = tokens.live(ctx.records, token_id)
    if holder is None:
        _end(ctx, digest, token_id)
        return None
    return Session(digest, holder, _csrf(secret))


def still_open(ctx: WebContext, session: Session, exists: bool) -> bool:
    """Whether a session checked earlier still holds: its key still ``exists`` in Redis (the
    caller read it, with whatever else it reads) and its token is not revoked."""
    if exists and tokens.live(ctx.records, session.holder.token_id) is not None:
        return True
    close_session(ctx, session)
    return False


def close_session(ctx: WebContext, session: Session) -> None:
    _end(ctx, session.digest, session.holder.token_id)


def _end(ctx: WebContext, digest: str, token_id: str) -> None:
    """Forget a session and its place among its token's sessions, together."""
    with ctx.store.client.pipeline(transaction=_together(ctx)) as pipe:
        pipe.delete(WEB_SESSION_PREFIX + digest)
        pipe.zrem(WEB_TOKEN_SESSIONS_PREFIX + token_id, digest)
        pipe.execute()


def _together(ctx: WebContext) -> bool:
    """A session's key and its token's list of sessions change in one transaction, except on
    a Redis Cluster, where they sit in two slots: there the pipeline's commands are sent in
    order per key, and a session missing from its token's list (a crash in between) only
    escapes the per-token cap until it expires."""
    return not ctx.store.clustered


def csrf_matches(expected: str, given: str | None) -> bool:
    return bool(given) and hmac.compare_digest(expected.encode(), str(given).encode())


def from_own_origin(request: Request) -> bool:
    """Whether the browser says a form post comes from this very origin. ``Sec-Fetch-Site``
    is set by the browser, not by a page; without it (an older browser, a script) the CSRF
    token alone decides."""
    site = request.headers.get("sec-fetch-site")
    return site is None or site.lower() in _OWN_ORIGIN


def may(session: Session, scope: Scope) -> bool:
    return scope is Scope.READ or session.may_operate


# -- the login form's CSRF value ---------------------------------------------------------------


def mint_login_value(ctx: WebContext) -> str:
    """A fresh login CSRF value: random, timestamped and signed with the server's login key,
    so a value the server did not mint (a cookie planted by another port of this host) fails."""
    nonce, stamp = secrets.token_urlsafe(16), str(int(time.time()))
    return f"{nonce}.{stamp}.{_sign(ctx, nonce, stamp)}"


def login_value_ok(ctx: WebContext, value: str) -> bool:
    """Whether ``value`` is one :func:`mint_login_value` made less than ``LOGIN_SECONDS`` ago."""
    nonce, stamp, signature = [*value.split("."), "", "", ""][:3]
    if not (nonce and signature and len(stamp) <= 12 and stamp.isascii() and stamp.isdecimal()):
        return False
    if not 0 <= time.time() - int(stamp) <= LOGIN_SECONDS:
        return False
    return hmac.compare_digest(signature, _sign(ctx, nonce, stamp))


def _sign(ctx: WebContext, nonce: str, stamp: str) -> str:
    key = _login_key(ctx.store.client)
    return hmac.new(key, f"{nonce}.{stamp}".encode(), hashlib.sha256).hexdigest()


def _login_key(client: redis.Redis) -> bytes:
    """One key for every server process of the deployment (a form from one, posted to
    another), made by whichever needs it first. A reader of Redis may mint login values, as
    anyone may by opening the form: what refuses a planted one from another origin is
    ``Sec-Fetch-Site``; the signature refuses values nobody minted."""
    client.set(WEB_LOGIN_KEY, secrets.token_hex(32), nx=True)
    key = client.get(WEB_LOGIN_KEY)
    if key is None:  # deleted between the two calls: make it again
        return _login_key(client)
    return str(key).encode()
