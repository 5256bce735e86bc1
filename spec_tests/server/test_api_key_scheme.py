"""The API key's ``Authorization`` scheme is case-insensitive (RFC 9110 11.1): a client sending ``bearer <key>``
(some HTTP libraries write it so) was a 401, while a wrong key in any spelling still is one."""

from __future__ import annotations

import pytest

from .conftest import make_settings, serve

KEY = "a-key-of-the-tests-0123"


@pytest.mark.parametrize(("header", "status"), [
    (f"Bearer {KEY}", 200), (f"bearer {KEY}", 200), (f"BEARER {KEY}", 200), (f"Bearer  {KEY}", 401),
    (f"bearer {KEY}x", 401), (f"Basic {KEY}", 401), (KEY, 401), (f"bearer{KEY}", 401), ("bearer ", 401),
])
async def test_the_bearer_scheme_is_read_in_any_case_and_only_the_key_counts(header: str, status: int) -> None:
    async with serve(make_settings(api_key=KEY)) as served:
        response = await served.client.get("/v1/stream/health", headers={"Authorization": header})
        body = await response.get_json()
    assert response.status_code == status, body
    if status == 401:
        assert body["error"] == "unauthorized", body
