"""The engine's step log inside `jhybrid serve`, for benchmarks that must explain a served latency tail.

    JHYBRID_ENGINE_SETUP=benchmarks.step_trace:record JHYBRID_STEP_LOG=/tmp/steps.json jhybrid serve ...

`record` (the engine set-up hook, run where the engine runs: the engine process by default) turns on
`LLMEngine.step_log` and the runner's `call_log` and writes them as JSON (`{"steps": [StepRecord fields...],
"calls": [CallRecord fields...], "gc": [...]}`, perf_counter seconds) when that process exits normally (the
server stopped by SIGTERM or SIGINT stops its engine in order). perf_counter is CLOCK_MONOTONIC on Linux, the
same clock in every process, so a client's load window slices the log.

`summarize(steps, t0, t1)` describes the steps that ended inside [t0, t1]: the interval between successive
step ends (what a decoding row waits between two tokens when the engine is the only delay), split into steps
that carried prompt tokens ("mixed") and steps that did not, with the host phases of each. The engine
dispatches a step before it reads the previous one, so a step ends when the previous step's results are read:
when the device is the bottleneck an interval is mostly the previous step's device time, and the host phases
of a step include waiting for the previous step's call (dispatch thread). The distribution of intervals is what
rows see either way; a slow interval's labels (rows, prompt tokens) are those of the step that ended it.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import time
from pathlib import Path

import numpy as np

FIELDS = ("start", "scheduled", "dispatched", "end", "rows", "tokens", "prompt_rows", "prompt_tokens", "restores",
          "snapshots", "device_wait", "read_start")


def record(engine) -> None:
    path = os.environ.get("JHYBRID_STEP_LOG")
    if not path:
        raise RuntimeError("benchmarks.step_trace:record needs JHYBRID_STEP_LOG=PATH (where the step log goes)")
    engine.step_log = []
    engine.runner.call_log = []
    collections = watch_gc()

    def dump():
        Path(path).write_text(json.dumps({"steps": [list(r) for r in engine.step_log],
                                          "calls": [list(r) for r in engine.runner.call_log], "gc": collections}))

    atexit.register(dump)


def watch_gc() -> list[list[float]]:
    """A list that gets `[start, seconds, generation]` (perf_counter) of every garbage collection from now on."""
    out: list[list[float]] = []
    started = [0.0]

    def callback(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            out.append([started[0], time.perf_counter() - started[0], info["generation"]])

    gc.callbacks.append(callback)
    return out


def summarize_gc(collections: list[list[float]], t0: float = float("-inf"), t1: float = float("inf")) -> dict:
    """Per generation: how many collections started inside [t0, t1] and their milliseconds."""
    out = {}
    for gen in (0, 1, 2):
        ms = [d * 1e3 for start, d, g in collections if g == gen and t0 <= start <= t1]
        out[f"gen{gen}"] = _pct(ms)
    return out


def _pct(values) -> dict[str, float]:
    v = np.asarray(values, np.float64)
    if v.size == 0:
        return {"n": 0}
    return {"n": int(v.size), "mean": float(v.mean()), **{f"p{q}": float(np.percentile(v, q)) for q in (50, 90, 99)},
            "max": float(v.max())}


def summarize(steps: list[list[float]], t0: float = float("-inf"), t1: float = float("inf")) -> dict:
    """Milliseconds: intervals between successive step ends (all, mixed, decode-only), the host phases (schedule,
    prepare + dispatch, device wait) and the prompt tokens of mixed steps, for the steps ending in [t0, t1]."""
    rows = [dict(zip(FIELDS, s)) for s in steps]
    out: dict = {"num_steps": 0}
    if len(rows) < 2:
        return out
    picked = [(prev, cur) for prev, cur in zip(rows, rows[1:]) if t0 <= cur["end"] <= t1]
    if not picked:
        return out
    ms = 1e3

    def part(pairs):
        return {
            "interval_ms": _pct([(c["end"] - p["end"]) * ms for p, c in pairs]),
            "schedule_ms": _pct([(c["scheduled"] - c["start"]) * ms for _, c in pairs]),
            "prepare_dispatch_ms": _pct([(c["dispatched"] - c["scheduled"]) * ms for _, c in pairs]),
            "device_wait_ms": _pct([c["device_wait"] * ms for _, c in pairs]),
            "rows": _pct([c["rows"] for _, c in pairs]),
            "prompt_tokens": _pct([c["prompt_tokens"] for _, c in pairs]),
        }

    mixed = [(p, c) for p, c in picked if c["prompt_tokens"] > 0]
    decode = [(p, c) for p, c in picked if c["prompt_tokens"] == 0]
    out.update(num_steps=len(picked), num_mixed=len(mixed), all=part(picked), mixed=part(mixed), decode=part(decode))
    # the slowest steps, with what they carried: the tail an inter-token latency P99 is made of
    slow = sorted(picked, key=lambda pc: pc[0]["end"] - pc[1]["end"])[:8]
    out["slowest"] = [{"interval_ms": (c["end"] - p["end"]) * ms, "rows": c["rows"], "tokens": c["tokens"],
                       "prompt_tokens": c["prompt_tokens"], "device_wait_ms": c["device_wait"] * ms,
                       "prepare_dispatch_ms": (c["dispatched"] - c["scheduled"]) * ms} for p, c in slow]
    return out


CALL_FIELDS = ("program", "queued", "started", "returned", "drain_wait")


def load(path) -> tuple[list, list, list]:
    """(steps, calls, garbage collections) of a file `record` wrote (an older file held the steps alone)."""
    data = json.loads(Path(path).read_text())
    return (data, [], []) if isinstance(data, list) else (data["steps"], data["calls"], data.get("gc", []))


def summarize_calls(calls: list[list], t0: float = float("-inf"), t1: float = float("inf")) -> dict:
    """Milliseconds, for the program calls that returned inside [t0, t1]: per program, how long its calls took
    (host time inside the call: argument handling, the CUDA graph's update and launch) and how long the engine
    waited for the call before each step; the slowest calls, with the program called just before each."""
    rows = [dict(zip(CALL_FIELDS, c)) for c in calls]
    picked = [(i, c) for i, c in enumerate(rows) if t0 <= c["returned"] <= t1]
    ms = 1e3
    by_program: dict[str, list] = {}
    for _, c in picked:
        by_program.setdefault(c["program"], []).append(c)
    out = {"num_calls": len(picked), "by_program": {
        name: {"call_ms": _pct([(c["returned"] - c["started"]) * ms for c in cs]),
               "drain_wait_ms": _pct([c["drain_wait"] * ms for c in cs])}
        for name, cs in sorted(by_program.items(), key=lambda kv: -len(kv[1]))}}
    slow = sorted(picked, key=lambda ic: ic[1]["started"] - ic[1]["returned"])[:12]
    out["slowest"] = [{"program": c["program"], "call_ms": (c["returned"] - c["started"]) * ms,
                       "queued_to_start_ms": (c["started"] - c["queued"]) * ms, "drain_wait_ms": c["drain_wait"] * ms,
                       "previous": rows[i - 1]["program"] if i else None,
                       "same_program_calls_since": _since_same(rows, i)} for i, c in slow]
    return out


def _since_same(rows: list[dict], i: int) -> int | None:
    """How many calls ago the program of call i was last called (None: never before)."""
    for back in range(1, i + 1):
        if rows[i - back]["program"] == rows[i]["program"]:
            return back
    return None


__all__ = ["CALL_FIELDS", "FIELDS", "load", "record", "summarize", "summarize_calls", "summarize_gc", "watch_gc"]
