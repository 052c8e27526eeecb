"""Start-up's objects are frozen out of the garbage collector's passes (jhybrid/engine/heap.py), so a full
collection during serving walks only what requests created, not the ~165k objects of the loaded stack."""

from __future__ import annotations

import gc
import weakref

import pytest

from jhybrid.engine.llm_engine import LLMEngine
from tests.conftest import ENGINE


@pytest.fixture(autouse=True)
def freezing(monkeypatch):
    """The suite turns the freeze off (tests/conftest.py); these tests are of the freeze."""
    monkeypatch.setenv("JHYBRID_GC_FREEZE", "1")


def test_the_freeze_can_be_turned_off(tiny, monkeypatch):
    """`JHYBRID_GC_FREEZE=0`: an engine built leaves nothing frozen (fails if the switch is ignored)."""
    monkeypatch.setenv("JHYBRID_GC_FREEZE", "0")
    gc.unfreeze()
    engine = LLMEngine(tiny[1], **ENGINE)
    assert gc.get_freeze_count() == 0 and not _frozen(engine.scheduler)


class _Node:
    pass


def _frozen(obj) -> bool:
    """Whether `obj` (tracked by the collector) sits in the permanent generation: `gc.get_objects()` leaves it out."""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


def test_engine_start_freezes_its_heap_and_a_second_engine_reclaims_the_first(tiny):
    """Built, the engine's objects are frozen (checked to fail without `freeze_startup_heap` in
    `LLMEngine.__init__`). A reference cycle frozen with the first engine and dropped since is reclaimed when the
    next engine starts (checked to fail without its `gc.unfreeze()`: the cycle stays frozen, never collected)."""
    cycle = _Node()
    cycle.self = cycle
    alive = weakref.ref(cycle)
    first = LLMEngine(tiny[1], **ENGINE)
    assert _frozen(first.scheduler) and _frozen(cycle) and gc.get_freeze_count() > 0
    del cycle, first
    gc.collect()
    assert alive() is not None  # frozen: the collector does not see it
    second = LLMEngine(tiny[1], **ENGINE)
    assert alive() is None, "a cycle frozen by an earlier engine was not reclaimed"
    assert _frozen(second.scheduler)


def test_a_step_program_compiled_later_is_frozen_too(tiny):
    """An engine without warm-up compiles each step program when a step first needs it; the program (and jax's
    cache entries made with it) is frozen right after. Checked to fail without the `freeze_startup_heap` call in
    `ModelRunner._program`."""
    from jhybrid import SamplingParams

    engine = LLMEngine(tiny[1], **ENGINE)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    programs = list(engine.runner._programs.values())
    assert programs and all(_frozen(p) for p in programs)
