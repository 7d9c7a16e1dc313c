"""The ``Saga-Signature`` header: HMAC-SHA256 over ``"<unix time>.<body>"``, as Stripe signs.

The timestamp is signed with the body, so a receiver that checks it (``verify``, default
tolerance 300 s) refuses a captured request replayed later; within the window, the notice id
(``Saga-Notice-Id``, also ``id`` in the body) is what tells a replay or a redelivery from a new
notice. A header may carry several ``v1=`` values (a key being rotated): any one may match.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from saga.errors import SignatureError

SIGNATURE_HEADER = "Saga-Signature"
NOTICE_ID_HEADER = "Saga-Notice-Id"
#: How far a signature's timestamp may be from the receiver's clock, in seconds.
DEFAULT_TOLERANCE = 300


def _digest(secret: str, timestamp: int, body: bytes) -> str:
    signed = str(timestamp).encode() + b"." + body
    return hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def sign(body: bytes, secret: str, timestamp: int | None = None) -> str:
    """The header value for ``body``: ``t=<unix time>,v1=<hex HMAC-SHA256>``."""
    when = int(time.time()) if timestamp is None else timestamp
    return f"t={when},v1={_digest(secret, when, body)}"


def verify(
    body: bytes,
    header: str | None,
    secret: str,
    tolerance: float = DEFAULT_TOLERANCE,
    now: float | None = None,
) -> int:
    """Check a received notice: the raw body as received (before any JSON parsing), the
    ``Saga-Signature`` header, the shared secret. Returns the signed timestamp; raises
    ``SignatureError`` saying what is wrong (missing, malformed, outside the window, no match).
    """
    if not header:
        raise SignatureError(f"no {SIGNATURE_HEADER} header")
    timestamp: int | None = None
    candidates = []
    for part in header.split(","):
        key, _, value = part.strip().partition("=")
        if key == "t":
            try:
                timestamp = int(value)
            except ValueError:
                raise SignatureError(f"malformed timestamp {value!r}") from None
        elif key == "v1":
            candidates.append(value)
    if timestamp is None or not candidates:
        raise SignatureError(f"malformed {SIGNATURE_HEADER} header (needs t= and v1=)")
    clock = time.time() if now is None else now
    if abs(clock - timestamp) > tolerance:
        raise SignatureError(
            f"timestamp {timestamp} is {abs(clock - timestamp):.0f}s from now "
            f"(tolerance {tolerance:g}s): a replay, or a clock out of sync"
        )
    expected = _digest(secret, timestamp, body)
    if not any(hmac.compare_digest(expected, candidate) for candidate in candidates):
        raise SignatureError("signature does not match the body and the secret")
    return timestamp
