"""Python's garbage collector and the serving loop: start-up's objects frozen out of its passes.

A full (generation 2) collection walks every tracked object. Once a model is loaded, its step programs
compiled and the server's stack imported that is 236k-722k objects, and a pass takes 107-330 ms on this
project's CI machine (benchmarks/RESULTS.md, session 13); it runs whenever enough new objects have survived,
i.e. in the middle of serving: between two engine steps, a gap every streaming request sees in its
inter-token latency, or in the HTTP process's event loop. `freeze_startup_heap` collects once and moves what is alive into the
permanent generation (`gc.freeze`), which later passes skip, as vLLM's engine does after start-up.

It unfreezes first, so that an engine built after another (tests, notebooks) lets the collector reclaim the
earlier engine's reference cycles before freezing again. A step program compiled later (an engine started
without warm-up compiles each shape when it first meets it: tracing and lowering leave ~100k objects in jax's
caches) freezes again without collecting (`collect=False`: a merge of lists, no pass over the heap).

`JHYBRID_GC_FREEZE=0` turns it off: a process that builds engine after engine and serves none (the test suite
builds hundreds) pays a full collection (~0.25 s on CI's machine) for each and gains nothing.
"""

from __future__ import annotations

import gc
import logging
import os
import time

log = logging.getLogger("jhybrid.engine")


def freeze_startup_heap(where: str, collect: bool = True) -> None:
    """Collects (unless `collect=False`), then freezes every object alive now out of the collector's passes (see
    the module docstring)."""
    if os.environ.get("JHYBRID_GC_FREEZE") == "0":
        return
    t0 = time.perf_counter()
    if collect:
        gc.unfreeze()
        gc.collect()
    gc.freeze()
    if log.isEnabledFor(logging.DEBUG):  # counting the frozen objects walks them (tens of ms)
        log.debug("%s: %d objects frozen out of garbage collection (%.0f ms)", where, gc.get_freeze_count(),
                  (time.perf_counter() - t0) * 1e3)
