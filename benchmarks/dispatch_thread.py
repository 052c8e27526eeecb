"""The offline engine with the step program's call on the dispatch thread and without it, in one process.

    PYTHONPATH=. python -m benchmarks.dispatch_thread [--batches 1,16,64] [--reps 3] [--json out.json]
    PYTHONPATH=. python -m benchmarks.dispatch_thread --tiny --batches 1,2 --reps 1     # CPU smoke test

The 2.2 B Qwen3-Next-shaped model of benchmarks/generate.py (random bf16 weights, full vocabulary), warmed
up; per batch size, `--reps` rounds of the same greedy requests (256-token prompts, 64 new tokens) with
`ModelRunner.dispatch_thread` off then on, alternating so that drift of the machine hits both alike. Per
mode: the median wall time of the all-decode steps (the engine dispatches step N+1 before it reads step N,
so in steady state this is the device step or the host loop, whichever is longer), the wall time of the
whole round (prefill included) and whether both modes produced the same tokens (they must).
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test)")
    parser.add_argument("--json")
    a = parser.parse_args(argv)

    import jax

    import jhybrid
    from benchmarks.decode_step import random_model, run_round

    batches = [int(b) for b in a.batches.split(",")]
    model = random_model(a.tiny)
    llm = jhybrid.LLM(model, dtype=None, max_num_seqs=max(batches), max_model_len=512, max_num_batched_tokens=2048,
                      warmup=True)
    eng, runner = llm.engine, llm.engine.runner
    sp = jhybrid.SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    vocab = model.cfg.vocab_size
    res = {"device": str(jax.devices()[0].device_kind), "rows": []}
    print(f"{res['device']}")
    print(f"| batch | dispatch thread | decode step ms (median of rounds) | round s | same tokens |")
    print("|---:|---|---:|---:|---|")
    for b in batches:
        prompts = [np.random.default_rng(i).integers(0, vocab, 256).tolist() for i in range(b)]
        steps = {False: [], True: []}
        walls = {False: [], True: []}
        outputs = {}
        run_round(eng, prompts, sp, f"w{b}")  # first touch of this batch's shapes
        for rep in range(a.reps):
            for mode in (False, True):
                runner.dispatch_thread = mode
                times, wall, tokens = run_round(eng, prompts, sp, f"{b}-{rep}-{mode}")
                steps[mode].append(float(np.median(times[4:] or times)) * 1e3)
                walls[mode].append(wall)
                outputs.setdefault(mode, tokens)
        same = outputs[False] == outputs[True]
        for mode in (False, True):
            row = {"batch": b, "dispatch_thread": mode, "step_ms": steps[mode], "round_s": walls[mode],
                   "same_tokens": same}
            res["rows"].append(row)
            print(f"| {b} | {'on' if mode else 'off'} | {np.median(steps[mode]):.3f} "
                  f"({', '.join(f'{x:.2f}' for x in steps[mode])}) | {np.median(walls[mode]):.3f} | {same} |",
                  flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=2)
    runner.dispatch_thread = True
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
