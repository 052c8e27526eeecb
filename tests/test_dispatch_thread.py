"""The step program's call on the runner's dispatch thread (`ModelRunner.dispatch_thread`, on by default on the
GPU, turned on here): the engine reads the previous step and schedules the next while the call launches, and
nothing it reads or replaces (the state, the token history, a step's outputs) is touched before the call
has returned.

Each test slows the call on the dispatch thread down (a sleep before it), so that a read that did not wait for
it would see the state before the step, which the step has donated: such a read fails or gives other tokens.
"""

from __future__ import annotations

import threading
import time

import pytest

from jhybrid import LLM, SamplingParams
from tests.conftest import ENGINE, GREEDY
from tests.test_programs import mixed_workload, run


@pytest.fixture(scope="module")
def model(tiny):
    return tiny[1]


def _slow_calls(runner, seconds: float = 0.005) -> set[str]:
    """Delays every step program call by `seconds` on whichever thread runs it; returns the set that collects
    those threads' names."""
    real, names = runner._call, set()

    def call(*args):
        names.add(threading.current_thread().name)
        time.sleep(seconds)
        return real(*args)

    runner._call = call
    return names


def _workloads():
    """Mixed requests (aborts, preemptions, sampling controls), then one of a 130-token prefix, then two more of
    that prefix: prefix-cache snapshots (copied from the state after a step) and restores (into a new slot
    before one) happen between calls."""
    shared = [(3 * k + 1) % 128 for k in range(130)]  # the tiny model has 128 tokens
    tail = [(shared + [7 + i] * (10 + i), SamplingParams(max_tokens=6, **GREEDY)) for i in range(3)]
    # penalised requests that take the slots of finished ones while a call is in flight: their token history
    # must start empty (written by `execute` before the call)
    penalised = SamplingParams(max_tokens=8, presence_penalty=1.5, repetition_penalty=1.5, **GREEDY)
    rows = [([(7 * k + i) % 128 for k in range(20 + 3 * i)], penalised) for i in range(10)]
    return mixed_workload(seed=3, lengths=(120, 300)), tail[:1], tail[1:], rows


def test_dispatch_thread_changes_no_token(model):
    """The same workloads give the same tokens and finish reasons with the calls on the dispatch thread (each
    made late) as with them inline. Zeroing, snapshot copies and restores are queued on the dispatch thread
    behind the step's call (`ModelRunner._state_op`). Checked to fail: with `_state_op` taking the state when
    it queues the copy instead of when it runs (the state before the step's call), the run raises on a deleted
    (donated) array (checked with the 5 ms delay); likewise, before `_state_op`, without the `drain()` in `ModelRunner.state`. (The `drain()` in `execute`, before the sampling tables and token history are written,
    is not reached first on today's paths: a row whose history is written is new in its slot, and the
    engine zeroes new slots, through `state`, before `execute`.)"""
    workloads, aborts = _workloads(), [{2: 3, 7: 9}, {}, {}, {}]
    threaded = LLM(model, **ENGINE, enable_prefix_caching=True)
    threaded.engine.runner.dispatch_thread = True
    names = _slow_calls(threaded.engine.runner)
    got = [run(threaded, work, at) for work, at in zip(workloads, aborts)]
    assert names and all(n.startswith("jhybrid-dispatch") for n in names), names
    assert all(reason != "error" for result in got for reason, _ in result.values())
    stats = threaded.engine.stats()
    assert stats["prefix_snapshots_taken"] > 0 and stats["prefix_cache_hits"] > 0
    assert threaded.engine.num_preemptions > 0

    inline = LLM(model, **ENGINE, enable_prefix_caching=True)
    inline.engine.runner.dispatch_thread = False
    names = _slow_calls(inline.engine.runner, 0.0)
    assert got == [run(inline, work, at) for work, at in zip(workloads, aborts)]
    assert names == {threading.current_thread().name}


def test_a_call_that_raises_on_the_dispatch_thread_fails_its_request_alone(model):
    """A step whose program call raises on the dispatch thread: the error reaches the engine when it next waits
    for the call, `safe_step` confines it to the request behind it, and the others finish with the tokens they
    get without it; nothing leaks. Checked to fail: with `safe_step` calling `step` unguarded, the error leaves
    the loop."""
    poison = [101, 102, 103]
    prompts = [[5 + i, 6, 7, 8, 9 + i, 10] for i in range(3)]
    sp = SamplingParams(max_tokens=8, **GREEDY)
    llm = LLM(model, **ENGINE)
    refs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]

    runner = llm.engine.runner
    runner.dispatch_thread = True
    _slow_calls(runner, 0.005)
    real_execute, slow_call = runner.execute, runner._call

    def fail(*args):
        time.sleep(0.005)
        raise RuntimeError("injected call fault")

    def execute(sched, prev):  # the call of a step with the poisoned row raises (on the dispatch thread)
        runner._call = fail if any(r.seq.prompt_ids[-3:] == poison for r in sched.rows) else slow_call
        try:
            return real_execute(sched, prev)
        finally:
            runner._call = slow_call

    runner.execute = execute
    eng = llm.engine
    for i, p in enumerate(prompts + [[20, 21] + poison]):
        eng.add_request(f"q{i}", p, sp)
    failed = []
    while eng.has_unfinished():
        failed += eng.safe_step()[1]
    assert [s.request_id for s in failed] == ["q3"]
    assert eng.requests["q3"].finish_reason == "error" and "injected call fault" in eng.requests["q3"].error
    assert [eng.requests[f"q{i}"].output_ids for i in range(3)] == refs
    for i in range(4):
        eng.release(f"q{i}")
    assert eng.blocks.num_used == 0 and eng.slots.num_used == 0
