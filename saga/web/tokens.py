"""The HTTP API's bearer tokens, kept in the records database (``saga_api_tokens``).

A token is ``saga_<id>_<secret>``: ``<id>`` (12 hex digits) is public and finds the row,
``<secret>`` is 256 random bits. Only the SHA-256 of the whole token is stored: with that much
entropy a plain hash cannot be reversed or brute-forced (a slow password hash buys nothing and
would cost every request), and a leaked table opens nothing. A presented token's digest is
compared with ``hmac.compare_digest``, in constant time. Nothing is cached, so a revoke takes
effect on the very next request.

Free of FastAPI: ``saga tokens`` uses it without the ``api`` extra.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from saga.errors import TokenError
from saga.records import RecordStore
from saga.records.models import TOKEN_NAME_LENGTH, ApiTokenRecord

__all__ = [
    "Scope",
    "TokenInfo",
    "check_token_name",
    "create",
    "list_tokens",
    "live",
    "revoke",
    "verify",
]

_PREFIX = "saga_"
_TOKEN = re.compile(r"saga_([0-9a-f]{12})_([A-Za-z0-9_-]{43})")
#: Printable names a person recognises in an audit trail: no control characters, no markup.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._@+-]*")


class Scope(StrEnum):
    """What a token may do: ``read`` only reads; ``operate`` may also act on runs."""

    READ = "read"
    OPERATE = "operate"


@dataclass(frozen=True)
class TokenInfo:
    """A token as a request carries it (never the secret)."""

    token_id: str
    name: str
    scope: Scope
    created_at: datetime
    revoked_at: datetime | None = None

    @property
    def may_operate(self) -> bool:
        return self.scope is Scope.OPERATE


def check_token_name(name: object) -> str:
    """``name`` if it is 1-100 characters of letters, digits, space and ``._@+-``, starting with
    a letter or digit; ``TokenError`` naming what is wrong otherwise."""
    if not isinstance(name, str) or not name:
        raise TokenError("a token's name must be a non-empty string (who acts with it)")
    if len(name) > TOKEN_NAME_LENGTH:
        raise TokenError(f"a token's name is at most {TOKEN_NAME_LENGTH} characters")
    if not _NAME.fullmatch(name):
        raise TokenError(
            f"token name {name[:40]!r}: letters, digits, space and ._@+- only, starting with "
            "a letter or digit"
        )
    return name


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create(records: RecordStore, name: str, scope: Scope | str) -> tuple[str, TokenInfo]:
    """A new token (shown once: only its digest is kept) and what it is. Names are unique
    among tokens not revoked, so the ``by`` of an action names one holder."""
    check_token_name(name)
    try:
        scope = Scope(scope)
    except ValueError:
        raise TokenError(f"scope {scope!r}: 'read' or 'operate'") from None
    token_id = secrets.token_hex(6)
    token = f"{_PREFIX}{token_id}_{secrets.token_urlsafe(32)}"
    row = ApiTokenRecord(
        token_id=token_id,
        digest=_digest(token),
        name=name,
        scope=scope.value,
        created_at=datetime.now(UTC),
    )
    try:
        with Session(records.engine, expire_on_commit=False) as session, session.begin():
            session.add(row)
    except IntegrityError:
        # The schema's unique index on live names (migration 0004): a check made before the
        # INSERT would let two creates at once both pass it.
        if not _taken(records, name):
            raise
        raise TokenError(
            f"a token named {name!r} exists: revoke it first, or pick another"
        ) from None
    return token, _info(row)


def _taken(records: RecordStore, name: str) -> bool:
    live = select(ApiTokenRecord.token_id).where(
        ApiTokenRecord.name == name, ApiTokenRecord.revoked_at.is_(None)
    )
    with Session(records.engine) as session:
        return session.execute(live).first() is not None


def verify(records: RecordStore, token: str) -> TokenInfo | None:
    """The token's holder, or None for a token that is malformed, unknown, or revoked."""
    match = _TOKEN.fullmatch(token)
    if match is None:
        return None
    with Session(records.engine) as session:
        row = session.get(ApiTokenRecord, match.group(1))
        if row is None:
            # The same work as a known id, so an unknown id takes no less time.
            hmac.compare_digest(_digest(token), _digest(""))
            return None
        matches = hmac.compare_digest(_digest(token), row.digest)
        if not matches or row.revoked_at is not None:
            return None
        return _info(row)


def live(records: RecordStore, token_id: str) -> TokenInfo | None:
    """The token of this id if it is not revoked (a console session's check on each page)."""
    with Session(records.engine) as session:
        row = session.get(ApiTokenRecord, token_id)
        return None if row is None or row.revoked_at is not None else _info(row)


def revoke(records: RecordStore, name: str) -> int:
    """Revoke the token of this name (the very next request with it is refused); how many
    were revoked. ``TokenError`` if no token of that name is live."""
    check_token_name(name)
    with Session(records.engine) as session, session.begin():
        done = session.execute(
            update(ApiTokenRecord)
            .where(ApiTokenRecord.name == name, ApiTokenRecord.revoked_at.is_(None))
            .values(revoked_at=datetime.now(UTC))
        )
    count = int(getattr(done, "rowcount", 0) or 0)
    if count == 0:
        raise TokenError(f"no live token named {name!r} (`saga tokens list` shows them)")
    return count


def list_tokens(records: RecordStore, *, revoked: bool = False) -> list[TokenInfo]:
    """Tokens, oldest first (the revoked ones too with ``revoked``)."""
    query = select(ApiTokenRecord).order_by(ApiTokenRecord.created_at)
    if not revoked:
        query = query.where(ApiTokenRecord.revoked_at.is_(None))
    with Session(records.engine) as session:
        return [_info(row) for row in session.scalars(query)]


def _info(row: ApiTokenRecord) -> TokenInfo:
    return TokenInfo(row.token_id, row.name, Scope(row.scope), row.created_at, row.revoked_at)
