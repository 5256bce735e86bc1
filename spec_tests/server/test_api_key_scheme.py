"""The API key's ``Authorization`` scheme is case-insensitive (RFC 9110 11.1): a client sending ``bearer <key>``
(some HTTP libraries write it so) was a 401, and so was one with two spaces before the key (one or more may come),
while a wrong key in any spelling still is one."""

from __future__ import annotations

import pytest

from .conftest import make_settings, serve

KEY = "a-key-of-the-tests-0123"


@pytest.mark.parametrize(("header", "status"), [
    (f"Bearer {KEY}", 200), (f"bearer {KEY}", 200), (f"BEARER {KEY}", 200), (f"Bearer  {KEY}", 200),
    (f"bearer {KEY}x", 401), (f"Basic {KEY}", 401), (KEY, 401), (f"bearer{KEY}", 401), ("bearer ", 401),
])
async def test_the_bearer_scheme_is_read_in_any_case_and_only_the_key_counts(header: str, status: int) -> None:
    async with serve(make_settings(api_key=KEY)) as served:
        response = await served.client.get("/v1/stream/health", headers={"Authorization": header})
        body = await response.get_json()
    assert response.status_code == status, body
    if status == 401:
        assert body["error"] == "unauthorized", body


@pytest.mark.parametrize(("headers", "words"), [
    ({}, "no Authorization header"),
    ({"Authorization": f"Basic {KEY}"}, "is not 'Bearer <api key>'"),
    ({"Authorization": "bearer "}, "is not 'Bearer <api key>'"),
    ({"Authorization": "Bearer not-the-key-of-this-server"}, "is not this server's API key"),
])
async def test_a_401_says_what_was_wrong_with_the_key_without_repeating_it(headers: dict[str, str], words: str) -> None:
    """A wrong key, a missing header and another scheme were one detail (``this route needs 'Authorization: Bearer
    <api key>'``): a client sending the header as told, with a stale key, was not told the key was the fault."""
    async with serve(make_settings(api_key=KEY)) as served:
        response = await served.client.get("/v1/stream/health", headers=headers)
        body = await response.get_json()
    assert response.status_code == 401 and body["error"] == "unauthorized", body
    assert words in body["detail"] and "Authorization: Bearer <api key>" in body["detail"], body
    assert KEY not in body["detail"] and "not-the-key" not in body["detail"], body
