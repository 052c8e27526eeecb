"""Garbage-collector pauses during generation, with start-up's heap frozen (`jhybrid/engine/heap.py`: what the
engine does) and not: how often each generation's pass ran and how long the longest took.

    PYTHONPATH=. python -m benchmarks.gc_pauses [--requests 64] [--max-tokens 64] [--json out.json]

Host-side: runs the bundled model with `jhybrid.LLM` (the server's stack imported too, as in `jhybrid serve`'s
processes), `gc.callbacks` timing every pass, with every program compiled first (`warmup`, as `jhybrid serve`
does) and without (each program compiles when a step first needs it, as `LLM` does by default). "not frozen"
is the engine with its `freeze_startup_heap` calls made no-ops (the code before them). The pauses fall between
engine steps, so each is a gap in every running stream's inter-token latency.
"""

from __future__ import annotations

import argparse
import gc
import json
import time


def run(frozen: bool, warmup: bool, requests: int, max_tokens: int) -> dict:
    import jhybrid
    import jhybrid.engine.llm_engine
    import jhybrid.engine.runner
    from jhybrid.assets import default_model_path
    from jhybrid.engine.heap import freeze_startup_heap

    gc.unfreeze()
    gc.collect()
    for module in (jhybrid.engine.llm_engine, jhybrid.engine.runner):
        module.freeze_startup_heap = freeze_startup_heap if frozen else (lambda *a, **k: None)

    import fastapi  # noqa: F401  (what the server processes hold too)
    import jhybrid.server.app  # noqa: F401

    llm = jhybrid.LLM(default_model_path(), max_num_seqs=16, max_model_len=256, warmup=warmup)
    sp = jhybrid.SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1)
    pauses, started = [], {}

    def on_gc(phase, info):
        if phase == "start":
            started[info["generation"]] = time.perf_counter()
        else:
            pauses.append((info["generation"], (time.perf_counter() - started[info["generation"]]) * 1e3))

    gc.callbacks.append(on_gc)
    t0 = time.perf_counter()
    llm.generate(["In the beginning"] * requests, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    gc.callbacks.remove(on_gc)
    row = dict(frozen=frozen, warmup=warmup, tracked_objects=len(gc.get_objects()), frozen_objects=gc.get_freeze_count(),
               generate_s=wall, programs_compiled=llm.engine.runner.num_compiled)
    for g in (0, 1, 2):
        ms = [p for gen, p in pauses if gen == g]
        row[f"gen{g}_passes"], row[f"gen{g}_max_ms"], row[f"gen{g}_total_ms"] = len(ms), max(ms, default=0.0), sum(ms)
    t1 = time.perf_counter()
    gc.collect()
    row["full_collect_ms"] = (time.perf_counter() - t1) * 1e3
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = [run(frozen, warmup, args.requests, args.max_tokens) for warmup in (False, True) for frozen in (False, True)]
    print("| programs | start-up heap | tracked objects after | gen-2 passes (max ms) | gen-1 passes (max ms) | gen-0 passes (max ms) "
          "| a full collection after, ms |\n|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {'warmed up' if r['warmup'] else 'compiled on first use'} | {'frozen' if r['frozen'] else 'not frozen'} | {r['tracked_objects']:,} | {r['gen2_passes']} "
              f"({r['gen2_max_ms']:.1f}) | {r['gen1_passes']} ({r['gen1_max_ms']:.1f}) | {r['gen0_passes']} "
              f"({r['gen0_max_ms']:.2f}) | {r['full_collect_ms']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
