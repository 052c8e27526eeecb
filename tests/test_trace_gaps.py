"""`benchmarks.trace_gaps` on a hand-built profiler trace: the device's busy and idle time inside an annotation, the
gaps grouped by the kernels around them, and the time before the first kernel and after the last."""

from __future__ import annotations

import gzip
import json

from benchmarks.trace_gaps import gaps, load


def _trace(tmp_path, mark: str):
    # host pid 1 (the annotation, 0-100 us), GPU pid 2: kernels at 10-30, 25-40 (overlapping), 60-70 and 95-99 us;
    # a kernel outside the annotation (200-210) is not counted
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}}]
    host = [{"ph": "X", "pid": 1, "tid": 1, "name": mark, "ts": 0.0, "dur": 100.0},
            {"ph": "X", "pid": 1, "tid": 1, "name": "cuGraphLaunch", "ts": 50.0, "dur": 20.0}]
    dev = [{"ph": "X", "pid": 2, "tid": 7, "name": n, "ts": t, "dur": d}
           for n, t, d in [("a", 10.0, 20.0), ("b", 25.0, 15.0), ("c", 60.0, 10.0), ("d", 95.0, 4.0),
                           ("late", 200.0, 10.0)]]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + host + dev}, f)
    return str(tmp_path)


def test_gaps_inside_a_named_annotation(tmp_path):
    """Busy 30 + 10 + 4 us, two gaps (40 -> 60 and 70 -> 95), 10 us before the first kernel and 1 us after the last;
    the host event running when the device resumed at 60 us is named. Checked to fail with the overlap of a and b
    counted twice (busy 49), and with the annotation's name ignored (the default `decode_only_step` finds none)."""
    events = load(_trace(tmp_path, "prefill_generate"))
    r = gaps(events, min_us=5.0, mark="prefill_generate")
    assert r["steps"] == 1
    assert abs(r["busy_ms_per_step"] - 0.044) < 1e-9
    assert abs(r["idle_ms_per_step_in_gaps"] - 0.045) < 1e-9 and r["gaps_per_step"] == 2
    assert abs(r["lead_ms"] - 0.010) < 1e-9 and abs(r["tail_ms"] - 0.001) < 1e-9
    assert abs(r["mark_ms_per_step"] - 0.100) < 1e-9
    groups = {(g["before"], g["after"]): g for g in r["groups"]}
    assert set(groups) == {("b", "c"), ("c", "d")}
    assert [n for n, _ in groups[("b", "c")]["host_at_resume"]] == ["cuGraphLaunch"]
    try:
        gaps(events, min_us=5.0)
    except ValueError as e:
        assert "decode_only_step" in str(e)
    else:
        raise AssertionError("the default annotation is not in this trace")
