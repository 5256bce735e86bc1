"""Stage placement of the toy world (pipelines/toy_world/placement.py, stages.py, ranks.py).

- a placement is validated when it is built, errors naming the stage and the problem;
- an actor object shared by two stages is started and closed once by the orchestrator;
- the same seed and controls give identical frames in-process, process with co-located decode, and
  process with independent decode (where the scheduler's latent artifacts hold only channel refs);
- a killed worker fails the sessions of its service, which reports itself failed (no restart);
  sessions of another service instance keep working.

Process-backed services spawn one process per rank (about a second each on 2 cores), so each test
starts as few as it needs.
"""

from __future__ import annotations


import json
import os
import signal
import threading
from collections.abc import Callable
from contextlib import aclosing, suppress
from typing import Any

import numpy as np
import pytest
import torch
import trio

from engine import EdgeSpec, LocalStageActor, PipelineSpec, StageSpec, open_orchestrator
from engine.tensor_channel import WorkerTensorRef
from engine.tensor_tree import leaves_of
from pipelines.contract import Control, ControlType, SessionConfig
from pipelines.toy_world import PipelineFailed, ServiceFailedError, get_service
from pipelines.toy_world.placement import (
    Placement,
    StageRuntime,
    load_placement,
    pipeline_spec,
)
from pipelines.toy_world.ranks import ResidentLatent
from server.cli import main as cli_main

SIZE = dict(height=32, width=48, frames_per_chunk=2)
CHUNKS = 4


def placement(mode: str = "process", *, denoise=("cpu",), decode=("cpu",), **extra: Any) -> dict[str, Any]:
    return {
        "mode": mode,
        "encode": {"devices": ["cpu"], "world_size": 1, "dtype": "float32"},
        "denoise": {"devices": list(denoise), "world_size": len(denoise)},
        "decode": {"devices": list(decode)},
        **extra,
    }


# -- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"decode": {"devices": ["cpu"], "world_size": 2}}, "stage 'decode': world_size 2 does not match 1 device(s) ['cpu']"),
        ({"denoise": {"devices": ["tpu:0"]}}, "stage 'denoise': unknown device 'tpu:0'"),
        ({"encode": {"devices": ["gpu0"]}}, "stage 'encode': unknown device 'gpu0'"),
        ({"encode": {"devices": []}}, "stage 'encode': needs at least one device"),
        ({"decode": {"devices": ["cpu"], "dtype": "int8"}}, "stage 'decode': dtype 'int8' is not one of"),
        ({"decode": {"devices": ["cpu"], "device": "cpu"}}, "stage 'decode': unknown runtime key(s) ['device']"),
        ({"mode": "threads"}, "placement mode must be one of ['in-process', 'process']"),
        ({"mode": "in-process", "denoise": {"devices": ["cpu", "cpu"]}}, "stage 'denoise': world_size 2 needs mode 'process'"),
        ({"resource_groups": [{"name": "g", "stages": ["render"]}]}, "resource group 'g': unknown stage 'render'"),
        # as `chunkline run` and `stream-serve` refuse it before loading (a Python caller, `chunkline worker`)
        ({"encode": {"devices": ["cpu"] * 17}}, "stage 'encode' asks for 17 ranks (one worker process each); a "
                                                "stage has at most 16"),
        ({stage: {"devices": ["cpu"] * 11} for stage in ("encode", "denoise", "decode")},
         "placement: the stages ask for 33 ranks in all ('encode' 11, 'denoise' 11, 'decode' 11); a placement has at "
         "most 32"),
    ],
)
def test_an_impossible_placement_is_refused_naming_the_stage(change, message):
    with pytest.raises(ValueError) as info:
        load_placement({**placement(), **change})
    assert message in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_is_refused_on_a_machine_without_it():
    with pytest.raises(ValueError, match=r"stage 'denoise': device 'cuda:0' asks for CUDA, but CUDA is not available"):
        load_placement(placement(denoise=("cuda:0",)))
    with pytest.raises(ValueError, match="stage 'decode'"):
        get_service(placement=placement(decode=("cuda",)), **SIZE)


def test_every_stage_needs_its_own_runtime_there_is_no_fallback():
    data = placement()
    del data["decode"]
    with pytest.raises(ValueError, match="stage 'decode': the placement gives no runtime for it"):
        load_placement(data)


def test_placement_file_inline_json_and_colocation(tmp_path):
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(placement(denoise=("cpu", "cpu"), decode=("cpu", "cpu"))))
    from_file = load_placement(str(path))
    assert from_file.colocated_decode and from_file.denoise.world_size == 2
    assert load_placement(json.dumps(placement())) == load_placement(placement())
    assert load_placement(placement()).colocated_decode
    assert not load_placement(placement(decode=("cpu", "cpu"))).colocated_decode  # same device, other world size
    assert not load_placement(placement("in-process")).colocated_decode
    assert Placement.from_dict(from_file.as_dict()) == from_file
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(placement(decode=("nope",))))
    with pytest.raises(ValueError, match=r"placement file .*bad.json.*: stage 'decode': unknown device 'nope'"):
        load_placement(str(bad))
    with pytest.raises(ValueError, match="does not exist"):
        load_placement(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"inline placement JSON names 'encode' twice in one object"):
        load_placement('{"encode": {"devices": ["cpu"]}, "encode": {"devices": ["cpu"], "world_size": 1}}')
    with pytest.raises(ValueError, match="either device or placement"):
        get_service(device="cpu", placement=placement(), **SIZE)


def test_resource_groups_are_only_ever_declared():
    spec = pipeline_spec(load_placement(placement(decode=("cpu", "cpu"))))  # independent stages on one device
    assert spec.resource_groups == () and all(s.resource_group is None for s in spec.stages)
    declared = load_placement(placement(resource_groups=[{"name": "cpu0", "max_concurrency": 1, "stages": ["encode", "decode"]}]))
    spec = pipeline_spec(declared)
    assert [(g.name, g.max_concurrency) for g in spec.resource_groups] == [("cpu0", 1)]
    assert {s.stage_id: s.resource_group for s in spec.stages} == {"encode": "cpu0", "denoise": None, "decode": "cpu0"}
    assert StageRuntime(("cpu",), 1) == load_placement(placement()).decode  # dtype defaults to float32


def test_the_cli_refuses_an_impossible_placement_with_the_stage(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(placement(decode=("cpu",), denoise=("cpu",)) | {"decode": {"devices": ["cpu"], "world_size": 3}}))
    out = tmp_path / "out"
    assert cli_main(["run", "pipelines/toy_world", "--placement", str(path), "--out", str(out)]) == 2
    assert "stage 'decode': world_size 3 does not match 1 device(s)" in capsys.readouterr().err
    assert not out.exists()
    assert cli_main(["run", "pipelines/toy_world", "--placement", str(tmp_path / "none.json")]) == 2
    assert "--placement: no such file" in capsys.readouterr().err


def test_stream_serve_settings_take_a_placement(tmp_path):
    from server.settings import ServerSettings, SettingsError

    path = tmp_path / "p.json"
    path.write_text(json.dumps(placement()))
    settings = ServerSettings.from_sources({"pipeline": "pipelines/toy_world"}, {"CHUNKLINE_PLACEMENT": str(path)})
    assert settings.placement == str(path)
    with pytest.raises(SettingsError, match="--placement"):
        ServerSettings(pipeline="pipelines/toy_world", placement=str(tmp_path / "missing.json"))


# -- one actor for two stages ----------------------------------------------------------------------


async def test_an_actor_shared_by_two_stages_starts_and_closes_once():
    calls: list[str] = []

    class Counting(LocalStageActor):
        async def run(self, **kwargs: Any) -> None:
            calls.append("run")
            await super().run(**kwargs)

        async def aclose(self) -> None:
            calls.append("aclose")
            await super().aclose()

    def handle(inv: Any) -> dict[str, Any]:
        return {"b": inv.inputs["a"] + 1} if inv.key.stage_id == "first" else {"c": inv.inputs["b"] * 10}

    hooks: list[str] = []
    shared = Counting(handle, session_closer=lambda ctx, reason: hooks.append(ctx.session_id), mailbox_capacity=2)
    spec = PipelineSpec(
        stages=[StageSpec("first", {"a"}, {"b"}), StageSpec("second", {"b"}, {"c"})],
        edges=[EdgeSpec("a", "first", None, 2), EdgeSpec("b", "second", "first", 2)],
        output_artifacts={"c"},
    )
    async with open_orchestrator(spec, {"first": shared, "second": shared}) as orch:
        async with orch.session("s", final_sequence_id=2) as session:
            for seq in range(3):
                await session.push(seq, {"a": seq})
            got = [(seq, artifacts["c"]) async for seq, artifacts in session.outputs()]
        await orch.barrier()
    assert got == [(0, 10), (1, 20), (2, 30)]
    assert calls == ["run", "aclose"]
    assert hooks == ["s", "s"]  # the session hook ran once per stage, on the one owner


# -- identical frames under every placement ------------------------------------------------------------


def _config() -> SessionConfig:
    timeline = ((0.0, Control(ControlType.CONTROL_STATE, keys=frozenset({"d", "w"}))),)
    return SessionConfig(prompt="a red sky", options={"continuous": True, "chunks": CHUNKS}, timeline=timeline)


async def _frames(service: Any) -> list[np.ndarray]:
    sid = await service.create_session(_config())
    async with aclosing(service.chunks(sid)) as chunks:
        frames = [chunk.frames async for chunk in chunks]
    await service.close_session(sid)
    return frames


def _spy(actor: Any, seen: list[Any], artifact: str) -> None:
    """Record what the scheduler hands the actor for ``artifact`` (on the actor's thread)."""
    build = actor._input_builder

    def spying(inv: Any) -> Any:
        if artifact in inv.inputs:
            seen.append(inv.inputs[artifact])
        return build(inv)

    actor._input_builder = spying


async def test_the_same_frames_in_process_colocated_and_over_a_channel():
    results: dict[str, list[np.ndarray]] = {}
    reference = get_service(seed=3, max_sessions=2, **SIZE)
    async with reference.running():
        results["in-process"] = await _frames(reference)

    colocated = get_service(seed=3, max_sessions=2, placement=placement(), **SIZE)
    async with colocated.running():
        actors = colocated._orch.actors
        assert actors["denoise"] is actors["decode"] and actors["encode"] is not actors["denoise"]
        latents: list[Any] = []
        _spy(actors["decode"], latents, "latent")
        results["colocated"] = await _frames(colocated)
        assert latents and all(isinstance(latent, ResidentLatent) for latent, _, _ in latents)
        assert all(leaves_of(artifact, torch.Tensor) == [] for artifact in latents)
        ranks = colocated._stages.groups["denoise"].pids
    assert all(not _alive(pid) for pid in ranks)

    independent = get_service(seed=3, max_sessions=2, placement=placement(decode=("cpu", "cpu")), **SIZE)
    async with independent.running():
        actors = independent._orch.actors
        assert len({id(a) for a in actors.values()}) == 3
        latents, conditions = [], []
        _spy(actors["decode"], latents, "latent")
        _spy(actors["denoise"], conditions, "condition")
        results["independent"] = await _frames(independent)
        # the scheduler's process never held a latent tensor: only channel refs on that edge
        assert len(latents) == CHUNKS
        for artifact in latents:
            assert leaves_of(artifact, torch.Tensor) == []
            refs = leaves_of(artifact, WorkerTensorRef)
            assert len(refs) == 1 and refs[0].shape == (SIZE["frames_per_chunk"], 48, 8, 12)
        # the base world reached the denoise ranks through a channel as well
        worlds = [c.world for c in conditions if c.world is not None]
        assert len(worlds) == 1 and isinstance(worlds[0], WorkerTensorRef)
        assert all(leaves_of(c, torch.Tensor) == [] for c in conditions)
        # a session closed at once (its world maybe never consumed) leaves the slot's channels usable
        quick = await independent.create_session(SessionConfig())
        await independent.close_session(quick)
        results["again"] = await _frames(independent)
        assert independent._stages.pool.in_use == 0 and independent._stages._pending_world == {}

    assert [len(f) for f in results.values()] == [CHUNKS] * 4
    for name in ("colocated", "independent", "again"):
        for a, b in zip(results["in-process"], results[name], strict=True):
            assert np.array_equal(a, b), name
    assert not np.array_equal(results["in-process"][0], results["in-process"][-1])  # the camera moved


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- a killed worker --------------------------------------------------------------------------------


async def _until_the_service_fails(victim: Any, config: SessionConfig, hurt: Callable[[], None], within: float) -> None:
    """Run one session of ``victim`` until its first chunk, ``hurt()`` a stage's rank, then wait (``within`` seconds
    at most) for the service to leave ``running()`` with its failure, which this raises."""
    async with victim.running():
        doomed = await victim.create_session(config)
        async with aclosing(victim.chunks(doomed)) as doomed_chunks:
            await doomed_chunks.__anext__()
            hurt()
            with trio.fail_after(within):  # cancelled by the service leaving running(), or the test fails
                with suppress(PipelineFailed):
                    async for _ in doomed_chunks:
                        pass
                await trio.sleep_forever()


async def test_a_frozen_worker_fails_its_service_once_a_call_goes_unanswered_past_the_call_timeout():
    """A rank stopped with SIGSTOP never answers: its session ran without frames for ever, and every later one of
    that service too. Past the placement's ``call_timeout`` the group fails, and the service with it, which its owner
    replaces; a bad ``call_timeout`` is refused naming it."""
    with pytest.raises(ValueError, match="call_timeout must be a number of seconds"):
        load_placement(placement(call_timeout=0))
    victim = get_service(seed=1, max_sessions=2, placement=placement(call_timeout=2.0), control_idle_timeout=60.0,
                         **SIZE)
    endless = SessionConfig(options={"continuous": True})
    frozen = None
    frozen: int | None = None

    def freeze() -> None:
        nonlocal frozen
        frozen = victim._stages.groups["denoise"].pids[0]
        os.kill(frozen, signal.SIGSTOP)

    try:
        with pytest.raises(ServiceFailedError, match="got no answer from ranks"):
            await _until_the_service_fails(victim, endless, freeze, within=30)
        assert victim.failure is not None and "stage 'denoise' failed" in victim.failure
    finally:
        if frozen is not None and _alive(frozen):
            os.kill(frozen, signal.SIGCONT)


async def test_an_in_process_stage_call_stuck_past_the_call_timeout_fails_its_service():
    """In-process, a stage call stuck in model code (a deadlock, a hung device) held its session without frames for
    ever, and the server's worker with it: the placement's ``call_timeout`` was for worker groups only. Now past it
    the stage's actor fails, and the service with it, which its owner replaces; the stuck thread is left to its call
    (the service does not wait for it on its way out)."""
    victim = get_service(seed=1, max_sessions=2, placement=placement("in-process", call_timeout=2.0),
                         control_idle_timeout=60.0, **SIZE)
    endless = SessionConfig(options={"continuous": True})
    release = threading.Event()

    def freeze() -> None:
        stages = victim._stages

        def stuck(invocation: Any) -> Any:
            release.wait()
            raise RuntimeError("released by the test")  # no model work on the abandoned thread as the test ends

        stages.denoise = stuck  # the service routes each denoise call through its stage host's method

    try:
        with pytest.raises(ServiceFailedError, match=r"stage 'denoise' failed: its call for session .* ran past its "
                                                     r"call_timeout of 2 s"):
            await _until_the_service_fails(victim, endless, freeze, within=30)
    finally:
        release.set()
        # the abandoned stage thread ends once its call returns: joined here, not left running torch code while the
        # interpreter exits (a test run ending on this test aborted: "terminate called without an active exception")
        for thread in [t for t in threading.enumerate() if t.name == "toy-world-denoise"]:
            await trio.to_thread.run_sync(thread.join, 10)


async def test_a_killed_worker_fails_its_services_sessions_and_the_service_leaves_running():
    """Interpretation: every session of one service uses every stage, so a dead rank fails the sessions
    of that service instance, and the service fails as a whole: it leaves ``running()`` at once with
    ServiceFailedError (its body is cancelled), so that its owner replaces it. Sessions of another
    service instance (another server worker) are unaffected."""
    victim = get_service(seed=1, max_sessions=2, placement=placement(), control_idle_timeout=60.0, **SIZE)
    other = get_service(seed=1, max_sessions=2, placement=placement("in-process"), control_idle_timeout=60.0, **SIZE)
    endless = SessionConfig(options={"continuous": True})
    async with other.running():
        survivor = await other.create_session(endless)
        async with aclosing(other.chunks(survivor)) as ok_chunks:
            await ok_chunks.__anext__()
            with pytest.raises(ServiceFailedError, match="stage 'denoise' failed"):
                await _until_the_service_fails(
                    victim, endless, lambda: os.kill(victim._stages.groups["denoise"].pids[0], signal.SIGKILL), within=20)
            assert victim.failure is not None and "stage 'denoise' failed" in victim.failure
            for _ in range(3):  # the other service's session goes on
                await ok_chunks.__anext__()
        await other.close_session(survivor)
        assert len(await _frames(other)) == CHUNKS  # and new sessions there work
