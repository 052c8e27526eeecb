"""Where the device idles inside a run of engine steps: reads a JAX profiler trace (perfetto JSON, as
`benchmarks.sampling_cost --trace` writes one per setting) and prints the GPU's idle gaps between the first and
the last `decode_only_step` annotation (`--mark`: another annotation, e.g. `benchmarks.prefill_timeline --trace`'s
`prefill_generate`).

    PYTHONPATH=. python -m benchmarks.trace_gaps DIR_OR_TRACE [--min-us 10] [--top 15] [--mark NAME] [--json out.json]

Per step: the time the GPU was busy (the union of all its streams' events) and idle. Then the idle gaps of at
least `--min-us`, grouped by the kernel before and the kernel after each, with their count and total per step;
for each group, the host events running when the GPU resumed (the innermost three by duration): what the host
was doing when the device got its next work, which says whether the gap waited for the host (a dispatch, a
copy) or for the device itself.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import gzip
import json
import os


def load(path: str) -> list[dict]:
    if os.path.isdir(path):
        (path,) = glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True)
    with gzip.open(path) as f:
        return json.load(f)["traceEvents"]


def gaps(events: list[dict], min_us: float = 10.0, mark: str = "decode_only_step") -> dict:
    names = {e["pid"]: e["args"].get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, n in names.items() if "GPU" in n.upper() and "HOST" not in n.upper()}
    marks = [e for e in events if e.get("ph") == "X" and e.get("name") == mark]
    if not marks or not gpu:
        raise ValueError(f"no {mark!r} annotations or no GPU events in the trace (processes: {sorted(names.values())})")
    start, end = min(e["ts"] for e in marks), max(e["ts"] + e["dur"] for e in marks)
    dev = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and start <= e["ts"] < end),
                 key=lambda e: e["ts"])
    host = [e for e in events if e.get("ph") == "X" and e.get("pid") not in gpu and e.get("dur", 0) > 0
            and e.get("name") != mark]
    host.sort(key=lambda e: e["ts"])
    host_starts = [e["ts"] for e in host]
    busy, idle = 0.0, []
    cur_end, prev = None, None
    for e in dev:
        e_end = e["ts"] + e.get("dur", 0)
        if cur_end is None:
            busy += e_end - e["ts"]
            cur_end, prev = e_end, e
            continue
        if e["ts"] > cur_end:
            if e["ts"] - cur_end >= min_us:
                idle.append((e["ts"] - cur_end, prev["name"], e["name"], e["ts"]))
            busy += e_end - e["ts"]
        elif e_end > cur_end:
            busy += e_end - cur_end
        if e_end >= cur_end:
            cur_end, prev = e_end, e
    steps = len(marks)
    span = (cur_end - dev[0]["ts"]) if dev else 0.0
    groups = collections.defaultdict(lambda: {"count": 0, "us": 0.0, "host": collections.Counter()})
    for dur, before, after, resume in idle:
        g = groups[(before, after)]
        g["count"] += 1
        g["us"] += dur
        # host events running at the moment the device resumed (started before it, ending after it)
        i = bisect.bisect_right(host_starts, resume)
        running = [h for h in host[max(0, i - 4000): i] if h["ts"] + h["dur"] >= resume]
        for h in sorted(running, key=lambda h: h["dur"])[:3]:
            g["host"][h["name"][:70]] += 1
    out = {"steps": steps, "busy_ms_per_step": busy / steps / 1e3, "span_ms_per_step": span / steps / 1e3,
           "mark_ms_per_step": (end - start) / steps / 1e3,  # the annotations' extent, host time included
           "lead_ms": ((dev[0]["ts"] - start) / 1e3) if dev else 0.0,  # the first annotation to the first kernel
           "tail_ms": ((end - cur_end) / 1e3) if dev else 0.0,  # the last kernel's end to the last annotation's
           "idle_ms_per_step_in_gaps": sum(d for d, *_ in idle) / steps / 1e3, "gaps_per_step": len(idle) / steps,
           "groups": sorted(({"before": b, "after": a, "count_per_step": g["count"] / steps,
                              "us_per_step": g["us"] / steps, "host_at_resume": g["host"].most_common(4)}
                             for (b, a), g in groups.items()), key=lambda g: -g["us_per_step"])}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", help="trace folders or perfetto_trace.json.gz files")
    parser.add_argument("--min-us", type=float, default=10.0)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--mark", default="decode_only_step", help="the host annotation whose span is examined")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    res = {}
    for path in args.traces:
        r = res[path] = gaps(load(path), args.min_us, args.mark)
        print(f"\n{path}: {r['steps']} steps; per step: span {r['span_ms_per_step']:.3f} ms, GPU busy "
              f"{r['busy_ms_per_step']:.3f} ms, idle in gaps >= {args.min_us:g} us {r['idle_ms_per_step_in_gaps']:.3f} ms "
              f"({r['gaps_per_step']:.1f} gaps); annotations {r['mark_ms_per_step']:.3f} ms a step, first kernel "
              f"{r['lead_ms']:.3f} ms after the first begins, last kernel ends {r['tail_ms']:.3f} ms before the last ends")
        for g in r["groups"][: args.top]:
            print(f"  {g['us_per_step']:8.1f} us/step {g['count_per_step']:5.2f}x  {g['before'][:40]} -> {g['after'][:40]}"
                  f"   host: {'; '.join(f'{n} ({c})' for n, c in g['host_at_resume'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
