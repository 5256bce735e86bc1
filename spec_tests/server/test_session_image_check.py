"""A create's image that the pipeline would refuse is a 400 naming the field, before anything is held.

The pipeline's own ``check_image`` (the very check its ``create_session`` runs; the toy world's is its 2 x 2
minimum) is asked with the size the image's header gives, in the round trip that checks the create's options, in
every worker mode: in-process, ``local-agents`` (over the agent's connection) and process workers (through the
service child's proxy). A 1 x 1 PNG was taken (200: a slot held, the upload written, a token given), and its
session failed ``pipeline_failed`` once its controller joined.
"""

from __future__ import annotations

import base64
import functools
import os
from pathlib import Path
from typing import Any

import pytest

from server.process_service import start_process_service

from . import runner_fixtures
from .conftest import assert_error_body, make_settings, png_bytes, serve
from .runner_fixtures import CounterService, wait_until

SESSIONS = "/v1/stream/sessions"
#: what the toy world says of an image under 2 x 2 pixels, after its size
TOO_SMALL = "pixels; the toy world takes one of at least 2 x 2"
#: file name -> (width, height): two the toy world refuses, and one it takes
IMAGES = {"dot.png": (1, 1), "line.png": (40, 1), "scene.png": (4, 4)}


@pytest.fixture(scope="module")
def small_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An assets directory with :data:`IMAGES` (module-scoped: a ``local-agents`` app with it is shared)."""
    root = tmp_path_factory.mktemp("small-assets")
    for name, (width, height) in IMAGES.items():
        (root / name).write_bytes(png_bytes(width, height))
    return root


def image_field(field: str, assets: Path, name: str) -> dict[str, str]:
    """The create's image ``name`` of ``assets``, uploaded or named by its path."""
    if field == "image_b64":
        return {"image_b64": base64.b64encode((assets / name).read_bytes()).decode()}
    return {"image_path": name}


def uploads(runtime: Any) -> set[str]:
    path = runtime.uploads.path
    return set(os.listdir(path)) if path is not None and os.path.isdir(path) else set()


@pytest.mark.parametrize("field", ["image_b64", "image_path"])
async def test_an_image_the_pipeline_does_not_take_is_a_400_naming_the_field_and_holds_nothing(
    small_assets: Path, worker_kind: Any, field: str
) -> None:
    settings = make_settings(assets_dir=str(small_assets), max_sessions_per_worker=1, queue_size=0)
    async with serve(settings, workers=worker_kind) as s:
        written = uploads(s.runtime)
        for name in ("dot.png", "line.png"):
            width, height = IMAGES[name]
            status, body, _ = await s.create("ctl", **image_field(field, small_assets, name))
            assert status == 400, (name, body)
            assert_error_body(status, body, "invalid_image")
            assert body["detail"].startswith(f"{field}: "), body
            assert f"is {width} x {height} {TOO_SMALL}" in body["detail"], body
            assert not list(s.runtime.registry), "a refused create left a record"
        assert uploads(s.runtime) == written, "a refused create left its upload"
        # the one slot is still free: the same create with an image the pipeline takes gets it
        status, body, _ = await s.create("ctl", **image_field(field, small_assets, "scene.png"))
        assert status == 200, body
        assert body["token"] and body["worker_id"] == s.worker_id


async def test_an_image_the_pipeline_does_not_take_is_refused_by_the_process_worker() -> None:
    loader = functools.partial(start_process_service, height=32, width=48, frames_per_chunk=2)
    settings = runner_fixtures.settings(pipeline="pipelines/toy_world", worker_mode="process",
                                        max_sessions_per_worker=1, queue_size=0)
    async with runner_fixtures.serve(settings, loader, ready=False) as s:
        await wait_until(lambda: s.runtime.ready, "the service child", deadline=120)
        status, body = await s.json("post", SESSIONS, json={"identity": "ctl",
                                                            "image_b64": base64.b64encode(png_bytes(1, 1)).decode()})
        assert (status, body["error"]) == (400, "invalid_image"), body
        assert body["detail"] == f"image_b64: the image is 1 x 1 {TOO_SMALL}", body
        # options and image in the one check: a refused option is said first, as without an image
        status, body = await s.json("post", SESSIONS, json={"identity": "ctl", "config": {"colour": "red"},
                                                            "image_b64": base64.b64encode(png_bytes(1, 1)).decode()})
        assert (status, body["error"]) == (400, "invalid_option"), body
        assert not list(s.runtime.registry) and s.free_slots() == 1
        created = await s.create("ctl", image_b64=base64.b64encode(png_bytes(4, 4)).decode())
        assert created["status"] == "assigned", created


async def test_a_pipeline_that_declares_no_image_check_takes_any_image() -> None:
    """The contract's default ``check_image`` takes every image: such a pipeline works as before."""
    async with runner_fixtures.serve(runner_fixtures.settings(), CounterService()) as s:
        created = await s.create("ctl", image_b64=base64.b64encode(png_bytes(1, 1)).decode())
        assert created["status"] == "assigned", created


class BrokenImageCheck(CounterService):
    async def check_image(self, width: int, height: int) -> None:
        raise KeyError("width")


async def test_an_image_check_that_raises_other_than_value_error_is_told_as_the_pipeline_s_bug() -> None:
    async with runner_fixtures.serve(runner_fixtures.settings(), BrokenImageCheck()) as s:
        status, body = await s.json("post", SESSIONS, json={"identity": "ctl",
                                                            "image_b64": base64.b64encode(png_bytes(4, 4)).decode()})
        assert (status, body["error"]) == (503, "no_worker"), body
        assert "pipeline bug: check_image raised KeyError: 'width'" in body["detail"], body
        assert "it must raise ValueError saying why it refuses an image" in body["detail"], body
        assert not list(s.runtime.registry) and s.free_slots() == 1


async def test_the_api_document_lists_the_refusal_of_an_image_among_a_create_s_400s() -> None:
    async with serve() as s:
        status, doc, _ = await s.json("get", "/openapi.json")
        assert status == 200, doc
        refused = doc["paths"][SESSIONS]["post"]["responses"]["400"]["description"]
        assert "invalid_image" in refused and "check_image" in refused, refused
        fields = doc["components"]["schemas"]["SessionCreateRequest"]["properties"]
        for field in ("image_b64", "image_path"):
            assert "invalid_image" in fields[field]["description"], fields[field]
