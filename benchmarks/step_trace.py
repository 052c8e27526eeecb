"""The engine's step log inside `jhybrid serve`, for benchmarks that must explain a served latency tail.

    JHYBRID_ENGINE_SETUP=benchmarks.step_trace:record JHYBRID_STEP_LOG=/tmp/steps.json jhybrid serve ...

`record` (the engine set-up hook, run where the engine runs: the engine process by default) turns on
`LLMEngine.step_log` and writes it as JSON (a list of `StepRecord` fields, perf_counter seconds) when that
process exits normally (the server stopped by SIGTERM or SIGINT stops its engine in order). perf_counter is
CLOCK_MONOTONIC on Linux, the same clock in every process, so a client's load window slices the log.

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
import json
import os
from pathlib import Path

import numpy as np

FIELDS = ("start", "scheduled", "dispatched", "end", "rows", "tokens", "prompt_rows", "prompt_tokens", "restores",
          "snapshots", "device_wait")


def record(engine) -> None:
    path = os.environ.get("JHYBRID_STEP_LOG")
    if not path:
        raise RuntimeError("benchmarks.step_trace:record needs JHYBRID_STEP_LOG=PATH (where the step log goes)")
    engine.step_log = []

    def dump():
        Path(path).write_text(json.dumps([list(r) for r in engine.step_log]))

    atexit.register(dump)


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


__all__ = ["FIELDS", "record", "summarize"]
