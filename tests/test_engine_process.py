"""The engine in a process of its own (`jhybrid/server/engine_process.py`, what `jhybrid serve` runs): the same
answers as the engine on a thread, faults injected into the engine process fail its requests only, and either
side going away is noticed.

The bundled model on the CPU, float32, greedy. The engine processes start without warm-up (each compiles its
few step shapes on its first requests).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from jhybrid.assets import default_model_path
from jhybrid.engine.engine_config import EngineConfig
from jhybrid.engine.sampling import SamplingParams
from jhybrid.server import BackgroundServer, ServerConfig, build_engine, create_app
from jhybrid.server.engine_process import EngineProcess, EngineSpec, EngineStartError

MODEL = "kjv"
PROMPTS = ["And God said", "The LORD is my shepherd", "In the beginning"]
OPTIONS = dict(dtype="float32", served_model_name=MODEL, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32)
POISON = 7  # a prompt holding this token id fails in the engine process's step (`poison_steps`)


def poison_steps(engine) -> None:
    """Runs in the engine process (`setup=`): a step whose rows hold a prompt with token POISON raises, as a
    device fault behind one request would."""
    real = engine.runner.execute

    def execute(sched, prev):
        if any(POISON in r.seq.prompt_ids for r in sched.rows):
            raise RuntimeError("injected fault")
        return real(sched, prev)

    engine.runner.execute = execute


async def _collect(engine, prompts, params, prefix="r"):
    async def one(i, prompt):
        deltas = [d async for d in engine.generate(f"{prefix}{i}", prompt, params)]
        return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], deltas[-1]

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


@pytest.fixture(scope="module")
def process_engine():
    engine = build_engine(default_model_path(), engine_process=True, setup="tests.test_engine_process:poison_steps",
                          **OPTIONS)
    engine.start()
    yield engine
    engine.shutdown()


def test_process_engine_answers_as_the_engine_on_a_thread(process_engine):
    """Greedy text, token ids, per-token logprobs and finish reasons from the engine process equal those of the
    same engine on a thread of this process (the reference: `AsyncEngine` over an in-process `LLMEngine`), and
    the request metrics and gauges reach this process's registry (the pool gauges from the engine's ready
    message, before any request: checked to fail with them set only from step outputs)."""
    before = process_engine.metrics.exposition().decode()
    assert 'jhybrid:state_slots_total{model_name="kjv"} 4.0' in before
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    got = asyncio.run(_collect(process_engine, PROMPTS, params))
    local = build_engine(default_model_path(), **OPTIONS).start()
    try:
        want = asyncio.run(_collect(local, PROMPTS, params))
    finally:
        local.shutdown()
    assert [(t, ids, d.finish_reason) for t, ids, d in got] == [(t, ids, d.finish_reason) for t, ids, d in want]
    assert all(len(ids) == 12 and text for text, ids, _ in got)
    for (_, _, a), (_, _, b) in zip(got, want):
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)
    assert process_engine.engine is None, "the LLMEngine must live in the other process"
    exposition = process_engine.metrics.exposition().decode()
    assert 'jhybrid:generation_tokens_total{model_name="kjv"} 36.0' in exposition
    assert process_engine.backend.process.pid != os.getpid() and process_engine.stats()["num_steps"] > 0


@pytest.mark.slow
def test_a_fault_in_the_engine_process_fails_its_request_only(process_engine):
    """A step that raises in the engine process (injected through `setup=`) ends the request behind it with
    finish_reason "error"; the requests beside it finish normally and the process serves on. Checked to fail
    with the injection's condition inverted (every other request then fails)."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 8], [5, POISON, 8], [9, 10, 11]]
    got = asyncio.run(_collect(process_engine, prompts, params, prefix="fault"))
    assert [d.finish_reason for *_, d in got] == ["length", "error", "length"]
    assert "injected fault" in got[1][2].error
    assert process_engine.is_alive
    again = asyncio.run(_collect(process_engine, [[5, 6, 8]], params, prefix="after"))
    assert again[0][1] == got[0][1]


@pytest.mark.slow
def test_a_dead_engine_process_fails_every_open_request_and_the_server_says_so():
    """SIGKILL of the engine process mid-stream: every open request ends with an error naming the death (none
    waits forever), `on_fatal` is called (the server then exits 1), /health answers 503 and new requests 503.
    Checked to fail with the receiver's EOF handling removed (the streams then hang until the test's timeout)."""
    engine = build_engine(default_model_path(), engine_process=True, **OPTIONS)
    fatal = []
    engine.on_fatal = fatal.append
    server = BackgroundServer(create_app(engine.start(), ServerConfig(model_names=(MODEL,)))).start()
    try:
        async def run():
            params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
            tasks = [asyncio.ensure_future(_collect(engine, [p], params, prefix=f"kill{i}")) for i, p in enumerate(PROMPTS)]
            while engine.stats().get("num_steps", 0) < 3:  # streaming
                await asyncio.sleep(0.05)
            os.kill(engine.backend.process.pid, signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)

        results = asyncio.run(run())
        assert [r[0][2].finish_reason for r in results] == ["error"] * 3
        assert all("engine process died" in r[0][2].error for r in results)
        deadline = time.monotonic() + 10  # on_fatal runs on the receiver thread right after the errors are delivered
        while not fatal and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(fatal) == 1 and not engine.is_alive
        assert httpx.get(server.url + "/health").status_code == 503
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "And", "max_tokens": 2})
        assert r.status_code == 503, r.text
    finally:
        server.stop()
        engine.shutdown(5)


@pytest.mark.slow
def test_the_engine_process_stops_when_the_server_goes_away():
    """The server's end of the pipe closing (its process died) stops the engine process: it exits on its own
    instead of holding the accelerator. Checked to fail with the reader's EOF branch removed (it then waits
    forever)."""
    config = EngineConfig(dtype="float32", max_num_seqs=2, max_model_len=64)
    process = EngineProcess(EngineSpec(default_model_path(), config), tokenizer=None)
    process._conn.close()
    deadline = time.monotonic() + 30
    while process.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process.process.poll() is not None, "the engine process outlived its server"


def test_an_engine_process_that_cannot_start_says_why(tmp_path):
    """A checkpoint the engine process cannot load: EngineStartError carrying the child's error, at once."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_next"}')  # no weights beside it
    with pytest.raises(EngineStartError, match="failed to start: FileNotFoundError: .* is not a checkpoint"):
        build_engine(str(tmp_path), engine_process=True, dtype="float32")
