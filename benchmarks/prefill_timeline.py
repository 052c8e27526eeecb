"""Where one long prefill's wall time goes through the public API: `LLM.generate` of one 8,192-token prompt with
`max_tokens=1` (the floors' prefill row), with the engine's step calls and reads timed on the host.

    PYTHONPATH=. python3 -m benchmarks.prefill_timeline [--model qwen3_next] [--length 8192] [--tiny] [--trace DIR]

Prints, per timed call, when each step program call started and returned and when its tokens were read (ms from
the start of `generate`), the rows and tokens of each step, and the whole call's wall time. With `--trace DIR` one
more call runs under the JAX profiler, inside a `prefill_generate` annotation: `python3 -m benchmarks.trace_gaps DIR
--mark prefill_generate` then says where the device idles during it.

`--zero-slots-ab` (a timing probe, not a mode to use) alternates the calls with and without the separate program
that zeroed a new request's state slot before its first step (`ModelRunner.zero_slots`): what that program costs
the call's wall time. The calls without it start from whatever the slot held, so their tokens are not checked and
not meant to be right. Since session 51 a mixed step's program zeroes its starting rows itself
(`jhybrid.engine.runner.ZERO_IN_STEP`), so the probe needs `JHYBRID_ZERO_IN_STEP=0`; the switch itself is timed
with `benchmarks.ab` and `JHYBRID_ZERO_IN_STEP=0` / `1` (benchmarks/RESULTS.md, "Session 51").
"""

from __future__ import annotations

import argparse
import time


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3_next", choices=("qwen3_next", "nemotron_h", "minimax"))
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--trace", metavar="DIR", help="trace one more call with the JAX profiler into DIR")
    ap.add_argument("--zero-slots-ab", action="store_true", help="alternate calls with and without the separate "
                    "slot-zeroing program (a timing probe: the calls without it are not correct)")
    a = ap.parse_args(argv)
    import jax

    import jhybrid
    from benchmarks.decode_step import random_params
    from jhybrid.engine import runner

    if a.zero_slots_ab and runner.ZERO_IN_STEP:
        raise SystemExit("--zero-slots-ab times the separate zeroing program, which a prefill step no longer runs: "
                         "set JHYBRID_ZERO_IN_STEP=0")
    from benchmarks.floors import hf_config
    from jhybrid.config import ModelConfig
    from jhybrid.model_loader import LoadedModel

    cfg = ModelConfig.from_hf(hf_config(a.model, a.tiny))
    model = LoadedModel(cfg=cfg, params=random_params(cfg), tokenizer=None)
    jax.block_until_ready(model.params)
    llm = jhybrid.LLM(model, dtype=None, max_num_seqs=1, max_model_len=a.length + 8, max_num_batched_tokens=a.length)
    engine = llm.engine
    events: list[tuple[str, float]] = []
    execute, read = engine.runner.execute, engine._take_tokens

    def timed_execute(sched, prev):
        events.append((f"call  {[r.num_tokens for r in sched.rows]} tokens", time.perf_counter()))
        out = execute(sched, prev)
        events.append(("  returned", time.perf_counter()))
        return out

    def timed_read(result):
        events.append(("read  start", time.perf_counter()))
        out = read(result)
        events.append(("  read done", time.perf_counter()))
        return out

    engine.runner.execute, engine._take_tokens = timed_execute, timed_read
    sp = jhybrid.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = cfg.vocab_size
    zero_slots = engine.runner.zero_slots
    walls: dict[str, list[float]] = {"with": [], "without": []}
    spans: list[float] = []  # the step calls' host time, called to returned (the calls with the zeroing program)
    for i in range(a.repeats + 1):
        for variant in ("with", "without") if a.zero_slots_ab and i else ("with",):
            engine.runner.zero_slots = zero_slots if variant == "with" else (lambda slots: None)
            events.clear()
            engine.runner.call_log = []  # the dispatch thread's program calls (queued, began, returned)
            prompt = [(7 * i + t) % vocab for t in range(a.length)]  # built before the clock starts
            t0 = time.perf_counter()
            llm.generate([prompt], sp, use_tqdm=False)
            wall = time.perf_counter() - t0
            label = f" ({variant} the slot-zeroing program)" if a.zero_slots_ab else ""
            print(f"generate #{i}{' (compiles)' if i == 0 else ''}{label}: {wall * 1e3:.1f} ms", flush=True)
            if i:
                walls[variant].append(wall * 1e3)
                if variant == "with":
                    called = [t for name, t in events if name.startswith("call")]
                    back = [t for name, t in events if name.strip() == "returned"]
                    spans.extend((r - c) * 1e3 for c, r in zip(called, back))
                for name, t in events:
                    print(f"  {(t - t0) * 1e3:9.2f} ms  {name}", flush=True)
                for c in engine.runner.call_log:
                    print(f"  {(c.started - t0) * 1e3:9.2f} ms  dispatch thread: {c.program} called (queued at "
                          f"{(c.queued - t0) * 1e3:.2f}), returned {(c.returned - t0) * 1e3:.2f}", flush=True)
            engine.runner.call_log = None
    engine.runner.zero_slots = zero_slots
    if walls["with"]:
        print(f"median of {len(walls['with'])}: generate {_median(walls['with']):.2f} ms, "
              f"step call {_median(spans):.2f} ms (host: called to returned)", flush=True)
    if a.zero_slots_ab:
        med = {k: _median(v) for k, v in walls.items()}
        print(f"zero-slots A/B, median of {a.repeats}: with {med['with']:.2f} ms, without {med['without']:.2f} ms "
              f"({med['with'] - med['without']:+.2f} ms for the program)", flush=True)
    if a.trace:
        prompt = [(5 * t + 3) % vocab for t in range(a.length)]
        with jax.profiler.trace(a.trace, create_perfetto_trace=True):
            with jax.profiler.TraceAnnotation("prefill_generate"):
                t0 = time.perf_counter()
                llm.generate([prompt], sp, use_tqdm=False)
        print(f"traced generate: {(time.perf_counter() - t0) * 1e3:.1f} ms (profiler on) -> {a.trace}", flush=True)


if __name__ == "__main__":
    main()
