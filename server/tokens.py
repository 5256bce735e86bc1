"""LiveKit access tokens: minting per role, verifying, and identity rules.

Tokens are HS256 JWTs minted with :class:`livekit.api.AccessToken`, so a real
LiveKit server accepts them, and verified with :class:`livekit.api.TokenVerifier`
(used by the local WebSocket transport, which plays the LiveKit server's part).

Grants (reference B.6; every role also gets ``room_join=True, room=<room>``):

============  ===========  ================  =============
role          can_publish  can_publish_data  can_subscribe
============  ===========  ================  =============
controller    False        True              True
viewer        False        False             True
worker        True         True              False
============  ===========  ================  =============

Every grant is written explicitly, ``False`` included, so a viewer token says
``canPublishData: false`` rather than relying on a server default. The role is
also put in the token metadata as JSON ``{"role": ...}`` and the participant
name is the identity.

Identities (:func:`validate_identity`): 1 to 128 characters from
``[A-Za-z0-9_.:@-]``. That set is safe in URLs, log lines, JSON
and LiveKit participant identities; no whitespace, no slashes, no control
characters. Uniqueness within a room is the session registry's job, not this
module's. Identities starting with ``chunkline-`` (in any case) belong to the
server's own participants: :func:`validate_client_identity` refuses them for
controllers and viewers, so nobody can pose as the worker.

Expiry is strict: verification uses a leeway of 0 (PyJWT's default through
livekit-api is 60 s). The issuer's ``clock`` sets the ``exp`` claim it mints
and is also checked at verification, so a fake clock in tests yields tokens
that are already expired.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Final, Literal

import attrs
import jwt
from livekit import api

__all__ = [
    "MAX_IDENTITY_LENGTH",
    "MAX_TOKEN_LIFE",
    "MIN_SECRET_BYTES",
    "ROLES",
    "IdentityError",
    "ReservedIdentity",
    "SERVER_IDENTITY_PREFIX",
    "SERVER_STATUS_IDENTITY",
    "Role",
    "TokenIssuer",
    "TokenRejected",
    "single_token",
    "VerifiedToken",
    "validate_client_identity",
    "validate_identity",
]

Role = Literal["controller", "viewer", "worker"]
ROLES: Final[frozenset[str]] = frozenset({"controller", "viewer", "worker"})

MAX_IDENTITY_LENGTH: Final = 128
#: the server's own participants (room runners, workers) are named with this prefix; clients may not be
SERVER_IDENTITY_PREFIX: Final = "chunkline-"
#: who a room's ``tf.status`` message is from when the server itself sends it (no worker is in the room)
SERVER_STATUS_IDENTITY: Final = SERVER_IDENTITY_PREFIX + "server"
#: the longest a token lasts (a controller's lasts its session's life): past year 9999 no expiry can be written
MAX_TOKEN_LIFE: Final = 365 * 24 * 3600.0
# PyJWT warns (an error under -W error) when an HS256 key is shorter than this.
MIN_SECRET_BYTES: Final = 32

_IDENTITY_RE: Final = re.compile(r"[A-Za-z0-9_.:@-]+")

# role -> (can_publish, can_publish_data, can_subscribe)
_GRANTS: Final[dict[str, tuple[bool, bool, bool]]] = {
    "controller": (False, True, True),
    "viewer": (False, False, True),
    "worker": (True, True, False),
}


_GRANT_CLAIMS: Final = ("canPublish", "canPublishData", "canSubscribe")


class IdentityError(ValueError):
    """An identity is empty, too long, or uses a character outside ``[A-Za-z0-9_.:@-]``."""


class ReservedIdentity(IdentityError):
    """A client asked for an identity the server keeps for its own participants."""


class TokenRejected(ValueError):
    """A token failed verification; ``reason`` is one of ``expired``,
    ``bad_signature`` (wrong secret or wrong API key), ``wrong_room`` or ``malformed``; ``detail`` says
    what exactly, in words a client can act on (never the token itself)."""

    def __init__(self, reason: str, detail: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail or _REJECTED.get(reason, reason)

    def refusal(self) -> str:
        """The room's answer to a client it does not admit (then it closes the socket)."""
        return json.dumps({"type": "refused", "reason": self.reason, "detail": self.detail})


def single_token(given: Sequence[str]) -> str:
    """The token of a room URL's ``?token=`` (``given``: every value), or TokenRejected when there is not one."""
    if len(given) > 1:  # which one would be meant?
        raise TokenRejected("malformed", f"the token is given {len(given)} times; give it once")
    return given[0] if given else ""


_REJECTED: Final = {
    "expired": "the token has expired: ask for a new one",
    "bad_signature": "the token was not signed by this server's key",
    "wrong_room": "the token is for another room",
    "wrong_role": "the token's role may not join this way",
    "session_closed": "the session has ended: its room is closed",
    "identity_in_use": "a participant with this identity is already in the room",
    "room_full": "the room has as many participants as it takes",
    "viewer_limit": "every viewer seat of the session is taken: try again when a viewer leaves",
}


def validate_identity(value: object) -> str:
    """Return ``value`` if it is a valid participant identity, else raise :class:`IdentityError`."""
    if not isinstance(value, str):
        raise IdentityError(f"identity must be a string, got {type(value).__name__}")
    if not value:
        raise IdentityError("identity must not be empty")
    if len(value) > MAX_IDENTITY_LENGTH:
        raise IdentityError(f"identity is {len(value)} characters; at most {MAX_IDENTITY_LENGTH} allowed")
    if _IDENTITY_RE.fullmatch(value) is None:
        raise IdentityError("identity may use only letters, digits and _ . : @ -")
    return value


def validate_client_identity(value: object) -> str:
    """:func:`validate_identity`, and not one of the server's own identities (any case of the prefix)."""
    identity = validate_identity(value)
    if identity.lower().startswith(SERVER_IDENTITY_PREFIX):
        raise ReservedIdentity(
            f"identities starting with {SERVER_IDENTITY_PREFIX!r} are reserved for the server's own participants"
        )
    return identity


def _require_room(room: object) -> str:
    if not isinstance(room, str) or not room:
        raise ValueError(f"room must be a non-empty string, got {room!r}")
    return room


@attrs.frozen
class VerifiedToken:
    """What a verified token grants."""

    identity: str
    room: str
    role: Role
    can_publish: bool
    can_publish_data: bool
    can_subscribe: bool
    expires_at: float  # the ``exp`` claim, Unix seconds


class TokenIssuer:
    """Mints and verifies room tokens for one LiveKit API key/secret pair.

    The secret never appears in ``repr``/``str``.
    """

    __slots__ = ("_api_key", "_api_secret", "_clock", "_ttl_seconds", "_verifier")

    def __init__(
        self,
        api_key: str,
        api_secret: str,
        ttl_seconds: float,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(api_key, str) or not api_key:
            raise ValueError("api_key must be a non-empty string")
        if not isinstance(api_secret, str) or len(api_secret.encode("utf-8")) < MIN_SECRET_BYTES:
            # Deliberately does not echo the secret.
            raise ValueError(f"api_secret must be a string of at least {MIN_SECRET_BYTES} bytes")
        if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int | float):
            raise ValueError(f"ttl_seconds must be a number, got {type(ttl_seconds).__name__}")
        if not (math.isfinite(ttl_seconds) and ttl_seconds > 0):
            raise ValueError(f"ttl_seconds must be finite and > 0, got {ttl_seconds!r}")
        self._api_key = api_key
        self._api_secret = api_secret
        self._ttl_seconds = float(ttl_seconds)
        self._clock = clock
        self._verifier = api.TokenVerifier(api_key, api_secret, leeway=datetime.timedelta(0))

    @classmethod
    def dev(cls, ttl_seconds: float = 3600.0, *, clock: Callable[[], float] = time.time) -> TokenIssuer:
        """An issuer with a random key and a random 64-character secret (local transport only)."""
        return cls(f"dev-{secrets.token_hex(6)}", secrets.token_urlsafe(48), ttl_seconds, clock=clock)

    @property
    def api_key(self) -> str:
        return self._api_key

    @property
    def ttl_seconds(self) -> float:
        return self._ttl_seconds

    def __repr__(self) -> str:
        return f"TokenIssuer(api_key={self._api_key!r}, ttl_seconds={self._ttl_seconds!r})"

    __str__ = __repr__

    def __reduce__(self) -> object:
        raise TypeError("TokenIssuer holds a secret and cannot be pickled")

    # -- minting --------------------------------------------------------------

    def controller_token(self, room: str, identity: str, *, lasting: float = 0.0) -> str:
        """Valid for the TTL, or for ``lasting`` seconds (its session's life) when that is longer, up to
        :data:`MAX_TOKEN_LIFE`: a controller cannot ask for another token, so one whose token expired before its
        session ended could not come back to it, nor join a session that waited in the queue past the TTL."""
        return self._mint("controller", room, identity, min(max(self._ttl_seconds, lasting), MAX_TOKEN_LIFE))

    def viewer_token(self, room: str, identity: str) -> str:
        return self._mint("viewer", room, identity)

    def worker_token(self, room: str, identity: str) -> str:
        return self._mint("worker", room, identity)

    def _mint(self, role: str, room: str, identity: str, ttl_seconds: float | None = None) -> str:
        room = _require_room(room)
        identity = validate_identity(identity)
        can_publish, can_publish_data, can_subscribe = _GRANTS[role]
        grants = api.VideoGrants(
            room_join=True,
            room=room,
            can_publish=can_publish,
            can_publish_data=can_publish_data,
            can_subscribe=can_subscribe,
        )
        # AccessToken stamps exp = wall clock + ttl; shift the ttl so that
        # exp = self._clock() + ttl_seconds (identical when clock is time.time).
        ttl = self._clock() + (ttl_seconds or self._ttl_seconds) - time.time()
        return (
            api.AccessToken(self._api_key, self._api_secret)
            .with_identity(identity)
            .with_name(identity)
            .with_metadata(json.dumps({"role": role}))
            .with_grants(grants)
            .with_ttl(datetime.timedelta(seconds=ttl))
            .to_jwt()
        )

    # -- verifying ------------------------------------------------------------

    def verify(self, token: str, *, room: str | None = None) -> VerifiedToken:
        """Check signature, issuer, expiry (leeway 0) and, if given, the room."""
        if not isinstance(token, str) or not token:
            raise TokenRejected("malformed", "no token: give the one a create or a viewer-token request returned")
        try:
            claims = self._verifier.verify(token)
            # Signature checked above; read what Claims does not expose.
            raw = jwt.decode(token, options={"verify_signature": False})
        except jwt.ExpiredSignatureError:
            raise TokenRejected("expired") from None
        except (jwt.InvalidSignatureError, jwt.InvalidIssuerError):
            raise TokenRejected("bad_signature") from None
        except (jwt.PyJWTError, ValueError, TypeError, AttributeError):
            # DecodeError, missing claims, an unsupported algorithm, grants of
            # the wrong shape (VideoGrants(**...) with odd values), ...
            raise TokenRejected("malformed", "the token is not one this server issued (it does not decode)") from None
        exp = raw.get("exp")
        if isinstance(exp, bool) or not isinstance(exp, int | float):
            raise TokenRejected("malformed", "the token has no expiry")
        if exp <= self._clock():
            raise TokenRejected("expired")
        video = claims.video
        if video is None or video.room_join is not True or not isinstance(video.room, str) or not video.room:
            raise TokenRejected("malformed", "the token grants no room to join")
        if room is not None and video.room != room:
            raise TokenRejected("wrong_room")
        role = _role_from_metadata(claims.metadata)
        try:
            identity = validate_identity(claims.identity)
        except IdentityError:
            raise TokenRejected("malformed", "the token's identity is not a valid identity") from None
        # VideoGrants defaults absent permissions to True; demand them explicit.
        raw_video = raw.get("video")
        flags = [raw_video.get(name) if isinstance(raw_video, dict) else None for name in _GRANT_CLAIMS]
        if not all(isinstance(flag, bool) for flag in flags):
            raise TokenRejected("malformed", "the token does not state each of its permissions")
        return VerifiedToken(
            identity=identity,
            room=video.room,
            role=role,
            can_publish=flags[0],
            can_publish_data=flags[1],
            can_subscribe=flags[2],
            expires_at=float(exp),
        )


def _role_from_metadata(metadata: object) -> Role:
    try:
        decoded = json.loads(metadata) if isinstance(metadata, str) else None
    except (ValueError, RecursionError):
        decoded = None
    role = decoded.get("role") if isinstance(decoded, dict) else None
    if role not in ROLES:
        raise TokenRejected("malformed", "the token names no role (controller, viewer or worker)")
    return role  # type: ignore[return-value]
