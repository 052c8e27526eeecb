"""Where the engine loop's host time goes (issues 16 and 21): the offline engine runs a serving-shaped workload
under cProfile, with its step log on, and prints the host phases per step and the functions that take the time.

    PYTHONPATH=. python -m benchmarks.host_profile [--prompt 10496 --shared 10240 --rows 5] [--json out.json]
    PYTHONPATH=. python -m benchmarks.host_profile --tiny --prompt 600 --shared 512 --groups 1     # CPU smoke test

The 2.2 B model of benchmarks/generate.py (random bf16 weights, its 151,936-token vocabulary; `--vocab` to
change it), `LLMEngine` as `jhybrid serve` builds it (warmed up: nothing compiles while profiled). The workload
is benchmarks/prefix_serve.py's shared-prefix one, run offline: `--groups` groups of `--rows` requests, each
group's prompts sharing `--shared` tokens of `--prompt`, all of a group added at once, `--max-tokens` greedy
new tokens each (with `--logprobs`: the top-0 logprobs the serving benchmark asks for). The first group is a
warm-up (not profiled).

Printed: per kind of step (decode only / with prompt tokens) the mean host time of scheduling, of preparing and
dispatching the step, of waiting for the device and of the rest of the loop (`LLMEngine.step_log`), then the
functions by own time and by cumulative time. A step is host-bound when prepare + schedule exceed the device
wait's share: the device then idles between steps.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import cProfile
import glob
import gzip
import io
import json
import os
import pstats

import numpy as np


def phases(log: list) -> dict:
    """Mean ms per step of each phase, per kind of step (decode only / with prompt tokens); `log`: StepRecords."""
    out = {}
    for name, keep in (("decode only", lambda r: r.prompt_rows == 0), ("with prompt", lambda r: r.prompt_rows > 0)):
        rs = [r for r in log if keep(r)]
        if rs:
            out[name] = {"steps": len(rs),
                         "schedule_ms": float(np.mean([r.scheduled - r.start for r in rs]) * 1e3),
                         "prepare_dispatch_ms": float(np.mean([r.dispatched - r.scheduled for r in rs]) * 1e3),
                         "device_wait_ms": float(np.mean([r.device_wait for r in rs]) * 1e3),
                         "rest_ms": float(np.mean([r.rest for r in rs]) * 1e3),
                         "step_ms": float(np.mean([r.end - r.start for r in rs]) * 1e3),
                         "rows": float(np.mean([r.rows for r in rs])), "tokens": float(np.mean([r.tokens for r in rs]))}
    return out


def device_time(folder: str) -> dict:
    """From a JAX profiler trace whose steps are annotated "decode_only_step" / "other_step": per kind of step,
    the GPU kernel time per step (kernels starting inside the kind's annotations) and the top kernels."""
    (trace,) = glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"].get("name", "") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, n in names.items() if "GPU" in n.upper() and "HOST" not in n.upper()}
    kernels = sorted((e["ts"], e.get("dur", 0), e["name"]) for e in events if e.get("ph") == "X" and e.get("pid") in gpu)
    starts = [k[0] for k in kernels]
    out = {}
    for kind in ("decode_only_step", "other_step"):
        marks = [e for e in events if e.get("ph") == "X" and e.get("name") == kind]
        if not marks:
            continue
        total, by_name = 0.0, collections.Counter()
        for m in marks:
            lo, hi = bisect.bisect_left(starts, m["ts"]), bisect.bisect_left(starts, m["ts"] + m["dur"])
            for _, dur, name in kernels[lo:hi]:
                total += dur
                by_name[name] += dur
        out[kind] = {"steps": len(marks), "kernel_ms_per_step": total / len(marks) / 1e3,
                     "annotated_ms_per_step": sum(m["dur"] for m in marks) / len(marks) / 1e3,
                     "top_kernels_ms_per_step": {n: d / len(marks) / 1e3 for n, d in by_name.most_common(12)}}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=10496)
    parser.add_argument("--shared", type=int, default=10240)
    parser.add_argument("--rows", type=int, default=5)
    parser.add_argument("--groups", type=int, default=3, help="profiled groups (after one warm-up group)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--prefix-caching", choices=["on", "off"], default="on")
    parser.add_argument("--logprobs", action="store_true", help="requests ask for logprobs=0, as prefix_serve's do")
    parser.add_argument("--top", type=int, default=30, help="functions printed")
    parser.add_argument("--trace", metavar="DIR", help="also run the profiled groups under the JAX profiler and "
                        "report GPU kernel time per step (traces under DIR)")
    parser.add_argument("--sync-before-dispatch", action="store_true",
                        help="wait for the previous step's outputs before dispatching the next (an experiment: does "
                        "the call itself wait for the device?)")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json")
    a = parser.parse_args(argv)

    import jax

    from benchmarks.decode_step import random_model
    from jhybrid import SamplingParams
    from jhybrid.engine.engine_config import EngineConfig
    from jhybrid.engine.llm_engine import LLMEngine

    max_len = 1 << (a.prompt + a.max_tokens - 1).bit_length()
    model = random_model(a.tiny, max_position_embeddings=max_len)
    vocab = model.cfg.vocab_size
    eng = LLMEngine(model, EngineConfig(dtype=None, max_num_seqs=a.rows, max_model_len=max_len, warmup=True,
                                        max_num_batched_tokens=a.max_num_batched_tokens, gpu_memory_utilization=0.6,
                                        enable_prefix_caching=a.prefix_caching == "on"))
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True,
                        logprobs=0 if a.logprobs else None)

    def run_group(g):
        system = rng.integers(0, vocab, a.shared).tolist()
        for i in range(a.rows):
            eng.add_request(f"g{g}-{i}", system + rng.integers(0, vocab, a.prompt - a.shared).tolist(), sp)
        while eng.has_unfinished():
            decode_only = all(s.num_uncomputed <= 1 for s in eng.scheduler.running) and not eng.scheduler.waiting
            with jax.profiler.TraceAnnotation("decode_only_step" if decode_only else "other_step"):
                eng.step()

    if a.sync_before_dispatch:
        execute = eng.runner.execute

        def synced(sched, prev):
            if prev is not None:
                jax.block_until_ready(prev.out)
            return execute(sched, prev)

        eng.runner.execute = synced
    run_group(-1)
    dispatch0 = eng.runner.dispatch_seconds
    eng.step_log = []
    profile = cProfile.Profile()
    with jax.profiler.trace(a.trace, create_perfetto_trace=True) if a.trace else contextlib.nullcontext():
        profile.enable()
        for g in range(a.groups):
            run_group(g)
        profile.disable()
    res = {"device": str(jax.devices()[0].device_kind), "args": vars(a), "phases": phases(eng.step_log),
           "programs_compiled_after_ready": eng.stats()["programs_compiled_after_ready"],
           "dispatch_ms_per_step": (eng.runner.dispatch_seconds - dispatch0) / max(len(eng.step_log), 1) * 1e3}
    if a.trace:
        res["device_time"] = device_time(a.trace)
        for kind, d in res["device_time"].items():
            print(f"{kind}: {d['steps']} steps, GPU kernels {d['kernel_ms_per_step']:.3f} ms per step, host loop "
                  f"{d['annotated_ms_per_step']:.3f} ms per step; top kernels (ms per step):")
            for name, ms in d["top_kernels_ms_per_step"].items():
                print(f"    {ms:7.3f}  {name[:110]}")
    print(f"{res['device']}; {a.rows} rows of {a.prompt} tokens ({a.shared} shared), vocab {vocab}, prefix caching "
          f"{a.prefix_caching}; ms per step:")
    print(f"{'step kind':12s} {'steps':>6s} {'rows':>5s} {'tokens':>7s} {'schedule':>9s} {'prep+disp':>10s} "
          f"{'dev wait':>9s} {'rest':>6s} {'step':>7s}")
    for name, p in res["phases"].items():
        print(f"{name:12s} {p['steps']:6d} {p['rows']:5.1f} {p['tokens']:7.0f} {p['schedule_ms']:9.2f} "
              f"{p['prepare_dispatch_ms']:10.2f} {p['device_wait_ms']:9.2f} {p['rest_ms']:6.2f} {p['step_ms']:7.2f}")
    print(f"of which the step program's call (all steps): {res['dispatch_ms_per_step']:.2f} ms per step")
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(key).print_stats(a.top)
        text = out.getvalue()
        res[f"profile_{key}"] = text
        print(text[text.index("ncalls") - 3 :] if "ncalls" in text else text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
