"""Room tokens: grants per role, strict verification, identity rules (server.tokens)."""

from __future__ import annotations

import datetime
import json
import pickle
import time

import jwt
import pytest
from livekit import api

from server.tokens import (
    IdentityError,
    TokenIssuer,
    TokenRejected,
    VerifiedToken,
    validate_identity,
)

KEY = "test-key"
SECRET = "s" * 16 + "0123456789abcdef-secret"  # >= 32 bytes
ROOM = "stage-1"


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def issuer() -> TokenIssuer:
    return TokenIssuer(KEY, SECRET, ttl_seconds=600)


def strict_verifier(key: str = KEY, secret: str = SECRET) -> api.TokenVerifier:
    return api.TokenVerifier(key, secret, leeway=datetime.timedelta(0))


def raw_claims(token: str) -> dict:
    return jwt.decode(token, options={"verify_signature": False})


# role -> (can_publish, can_publish_data, can_subscribe)
EXPECTED_GRANTS = {
    "controller": (False, True, True),
    "viewer": (False, False, True),
    "worker": (True, True, False),
}


def mint(issuer: TokenIssuer, role: str, room: str = ROOM, identity: str = "p-1") -> str:
    return getattr(issuer, f"{role}_token")(room, identity)


@pytest.mark.parametrize("role", sorted(EXPECTED_GRANTS))
def test_grants_per_role_as_livekit_reads_them(issuer: TokenIssuer, role: str) -> None:
    token = mint(issuer, role, identity=f"{role}-7")
    claims = strict_verifier().verify(token)
    assert claims.identity == f"{role}-7"
    assert claims.name == f"{role}-7"
    assert json.loads(claims.metadata) == {"role": role}
    video = claims.video
    assert video.room_join is True and video.room == ROOM
    assert (video.can_publish, video.can_publish_data, video.can_subscribe) == EXPECTED_GRANTS[role]
    # Every permission is written out (no reliance on LiveKit defaults) and
    # nothing beyond room_join/room/the three permissions is granted.
    raw_video = raw_claims(token)["video"]
    assert raw_video == {
        "roomJoin": True,
        "room": ROOM,
        "canPublish": EXPECTED_GRANTS[role][0],
        "canPublishData": EXPECTED_GRANTS[role][1],
        "canSubscribe": EXPECTED_GRANTS[role][2],
    }


def test_viewer_cannot_publish_data_explicitly(issuer: TokenIssuer) -> None:
    raw = raw_claims(issuer.viewer_token(ROOM, "viewer-1"))
    assert raw["video"]["canPublishData"] is False
    assert raw["video"]["canPublish"] is False


@pytest.mark.parametrize("role", sorted(EXPECTED_GRANTS))
def test_verify_round_trip(issuer: TokenIssuer, role: str) -> None:
    before = time.time()
    verified = issuer.verify(mint(issuer, role, identity="who@host"), room=ROOM)
    publish, publish_data, subscribe = EXPECTED_GRANTS[role]
    assert verified == VerifiedToken(
        identity="who@host",
        room=ROOM,
        role=role,
        can_publish=publish,
        can_publish_data=publish_data,
        can_subscribe=subscribe,
        expires_at=verified.expires_at,
    )
    assert before + 600 - 1 <= verified.expires_at <= time.time() + 600
    # room=None skips the room check
    assert issuer.verify(mint(issuer, role)).room == ROOM


def test_ttl_sets_expiry(issuer: TokenIssuer) -> None:
    now = time.time()
    raw = raw_claims(issuer.controller_token(ROOM, "c"))
    assert now + 600 - 1 <= raw["exp"] <= now + 601


def test_expired_token_is_rejected_with_no_leeway() -> None:
    # Minted 5 s past its expiry: the livekit default leeway of 60 s would accept it.
    clock = FakeClock(time.time() - 65)
    old = TokenIssuer(KEY, SECRET, ttl_seconds=60, clock=clock)
    token = old.controller_token(ROOM, "c-1")
    assert api.TokenVerifier(KEY, SECRET).verify(token).identity == "c-1"  # default leeway
    with pytest.raises(jwt.ExpiredSignatureError):
        strict_verifier().verify(token)
    with pytest.raises(TokenRejected) as info:
        TokenIssuer(KEY, SECRET, ttl_seconds=60).verify(token)
    assert info.value.reason == "expired"


def test_expiry_follows_the_issuer_clock() -> None:
    clock = FakeClock(time.time())
    issuer = TokenIssuer(KEY, SECRET, ttl_seconds=30, clock=clock)
    token = issuer.worker_token(ROOM, "worker-1")
    assert issuer.verify(token).role == "worker"
    clock.now += 31
    with pytest.raises(TokenRejected) as info:
        issuer.verify(token)
    assert info.value.reason == "expired"


def test_wrong_secret_is_bad_signature(issuer: TokenIssuer) -> None:
    other = TokenIssuer(KEY, "x" * 40, ttl_seconds=600)
    with pytest.raises(TokenRejected) as info:
        issuer.verify(other.controller_token(ROOM, "c"))
    assert info.value.reason == "bad_signature"
    assert str(info.value) == "bad_signature"


def test_wrong_key_is_bad_signature(issuer: TokenIssuer) -> None:
    other = TokenIssuer("another-key", SECRET, ttl_seconds=600)
    with pytest.raises(TokenRejected) as info:
        issuer.verify(other.controller_token(ROOM, "c"))
    assert info.value.reason == "bad_signature"


def test_tampered_payload_is_bad_signature(issuer: TokenIssuer) -> None:
    header, _payload, signature = issuer.viewer_token(ROOM, "v").split(".")
    forged = jwt.encode({"sub": "v"}, "y" * 40, algorithm="HS256").split(".")[1]
    with pytest.raises(TokenRejected) as info:
        issuer.verify(f"{header}.{forged}.{signature}")
    assert info.value.reason == "bad_signature"


def test_wrong_room(issuer: TokenIssuer) -> None:
    with pytest.raises(TokenRejected) as info:
        issuer.verify(issuer.controller_token(ROOM, "c"), room="other-room")
    assert info.value.reason == "wrong_room"


@pytest.mark.parametrize(
    "garbage",
    ["", "garbage", "a.b.c", "....", "\u2603", "e30.e30.e30", None, 42],
)
def test_garbage_is_malformed(issuer: TokenIssuer, garbage: object) -> None:
    with pytest.raises(TokenRejected) as info:
        issuer.verify(garbage)  # type: ignore[arg-type]
    assert info.value.reason == "malformed"


def hand_rolled(claims: dict, secret: str = SECRET, algorithm: str = "HS256") -> str:
    base = {"iss": KEY, "sub": "c-1", "exp": int(time.time()) + 600, "nbf": int(time.time())}
    return jwt.encode({**base, **claims}, secret, algorithm=algorithm)


GOOD_VIDEO = {"roomJoin": True, "room": ROOM, "canPublish": False, "canPublishData": True, "canSubscribe": True}


@pytest.mark.parametrize(
    "claims",
    [
        pytest.param({"metadata": json.dumps({"role": "controller"})}, id="no-video"),
        pytest.param({"video": GOOD_VIDEO}, id="no-metadata"),
        pytest.param({"video": GOOD_VIDEO, "metadata": "not json"}, id="metadata-not-json"),
        pytest.param({"video": GOOD_VIDEO, "metadata": json.dumps({"role": "admin"})}, id="unknown-role"),
        pytest.param({"video": GOOD_VIDEO, "metadata": json.dumps(["controller"])}, id="metadata-list"),
        pytest.param(
            {"video": {**GOOD_VIDEO, "roomJoin": False}, "metadata": json.dumps({"role": "controller"})},
            id="no-room-join",
        ),
        pytest.param(
            {
                "video": {k: v for k, v in GOOD_VIDEO.items() if k != "canPublishData"},
                "metadata": json.dumps({"role": "controller"}),
            },
            id="implicit-permission",
        ),
        pytest.param(
            {"video": GOOD_VIDEO, "metadata": json.dumps({"role": "controller"}), "sub": "has space"},
            id="bad-identity",
        ),
        pytest.param({"video": ["x"], "metadata": json.dumps({"role": "controller"})}, id="video-list"),
    ],
)
def test_signed_but_malformed_claims(issuer: TokenIssuer, claims: dict) -> None:
    with pytest.raises(TokenRejected) as info:
        issuer.verify(hand_rolled(claims))
    assert info.value.reason == "malformed"


def test_hand_rolled_well_formed_token_verifies(issuer: TokenIssuer) -> None:
    token = hand_rolled({"video": GOOD_VIDEO, "metadata": json.dumps({"role": "controller"})})
    assert issuer.verify(token, room=ROOM).role == "controller"


def test_token_without_exp_is_malformed(issuer: TokenIssuer) -> None:
    token = jwt.encode(
        {"iss": KEY, "sub": "c", "video": GOOD_VIDEO, "metadata": json.dumps({"role": "controller"})},
        SECRET,
        algorithm="HS256",
    )
    with pytest.raises(TokenRejected) as info:
        issuer.verify(token)
    assert info.value.reason == "malformed"


def test_header_without_signature_is_bad_signature(issuer: TokenIssuer) -> None:
    with pytest.raises(TokenRejected) as info:
        issuer.verify("eyJhbGciOiJIUzI1NiJ9..")
    assert info.value.reason == "bad_signature"


@pytest.mark.parametrize("algorithm", ["HS512", "none"])
def test_other_algorithm_is_malformed(algorithm: str) -> None:
    secret = "z" * 64  # long enough for HS512 without a key-length warning
    issuer = TokenIssuer(KEY, secret, ttl_seconds=600)
    token = hand_rolled(
        {"video": GOOD_VIDEO, "metadata": json.dumps({"role": "controller"})},
        secret=secret if algorithm != "none" else None,  # type: ignore[arg-type]
        algorithm=algorithm,
    )
    with pytest.raises(TokenRejected) as info:
        issuer.verify(token)
    assert info.value.reason == "malformed"


def test_secret_never_shown(issuer: TokenIssuer) -> None:
    assert SECRET not in repr(issuer)
    assert SECRET not in str(issuer)
    assert KEY in repr(issuer)
    with pytest.raises(TypeError):
        pickle.dumps(issuer)


def test_dev_issuer_has_random_strong_credentials() -> None:
    first, second = TokenIssuer.dev(), TokenIssuer.dev()
    assert first.api_key != second.api_key
    assert first.verify(first.viewer_token(ROOM, "v")).role == "viewer"
    with pytest.raises(TokenRejected):
        second.verify(first.viewer_token(ROOM, "v"))


@pytest.mark.parametrize(
    "secret", ["", "short", "x" * 31, "é" * 15]  # 30 bytes
)
def test_short_secret_refused_without_echo(secret: str) -> None:
    with pytest.raises(ValueError) as info:
        TokenIssuer(KEY, secret, ttl_seconds=60)
    assert secret == "" or secret not in str(info.value)


def test_multibyte_secret_counts_bytes() -> None:
    TokenIssuer(KEY, "é" * 16, ttl_seconds=60)  # 32 bytes, 16 characters


@pytest.mark.parametrize("ttl", [0, -1, float("nan"), float("inf"), True, "60"])
def test_bad_ttl(ttl: object) -> None:
    with pytest.raises(ValueError):
        TokenIssuer(KEY, SECRET, ttl_seconds=ttl)  # type: ignore[arg-type]


def test_empty_key_refused() -> None:
    with pytest.raises(ValueError):
        TokenIssuer("", SECRET, ttl_seconds=60)


@pytest.mark.parametrize("room", ["", None, 3])
def test_minting_needs_a_room(issuer: TokenIssuer, room: object) -> None:
    with pytest.raises(ValueError):
        issuer.controller_token(room, "c")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "identity",
    ["a", "viewer-1", "user@example.com", "ns:worker.3", "A_B-c.d:e@f", "0", "x" * 128],
)
def test_good_identities(issuer: TokenIssuer, identity: str) -> None:
    assert validate_identity(identity) == identity
    assert issuer.verify(issuer.viewer_token(ROOM, identity)).identity == identity


@pytest.mark.parametrize(
    "identity",
    ["", "x" * 129, "has space", "tab\t", "new\nline", "slash/", "back\\slash", "é", "emoji\U0001f600",
     "quote'", 'dq"', "nul\x00", "semi;", "hash#", "q?", None, 5, b"bytes"],
)
def test_bad_identities(issuer: TokenIssuer, identity: object) -> None:
    with pytest.raises(IdentityError):
        validate_identity(identity)
    with pytest.raises(ValueError):
        issuer.controller_token(ROOM, identity)  # type: ignore[arg-type]


def test_identity_error_is_a_value_error() -> None:
    assert issubclass(IdentityError, ValueError)
    assert issubclass(TokenRejected, ValueError)
