"""The offline engine with one of its switches off and on, in one process: the step program's call on the
dispatch thread (`--switch dispatch_thread`, the default) or a step's text written after the next step's dispatch
(`--switch defer_postprocess`, `jhybrid.engine.llm_engine.DEFER_POSTPROCESS`).

    PYTHONPATH=. python -m benchmarks.dispatch_thread [--batches 1,16,64] [--reps 3] [--json out.json]
    PYTHONPATH=. python -m benchmarks.dispatch_thread --switch defer_postprocess --model nemotron_h --batches 1
    PYTHONPATH=. python -m benchmarks.dispatch_thread --tiny --batches 1,2 --reps 1     # CPU smoke test

The 2.2 B Qwen3-Next-shaped model of benchmarks/generate.py (random bf16 weights, full vocabulary; `--model`:
one of `benchmarks.floors`' models instead), warmed up; per batch size, `--reps` rounds of the same requests
(256-token prompts, 64 new tokens; greedy, or `--setting every`: `benchmarks.sampling_cost`'s every control but
the bad words) with the switch off then on, alternating so that drift of the machine hits both alike. Per
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
    parser.add_argument("--switch", choices=("dispatch_thread", "defer_postprocess"), default="dispatch_thread")
    parser.add_argument("--model", choices=("qwen3_next", "nemotron_h", "minimax"), default="qwen3_next")
    parser.add_argument("--setting", choices=("greedy", "every"), default="greedy")
    parser.add_argument("--json")
    a = parser.parse_args(argv)

    import jax

    import jhybrid
    from benchmarks.decode_step import random_model, random_params, run_round
    from jhybrid.engine import llm_engine

    batches = [int(b) for b in a.batches.split(",")]
    if a.model == "qwen3_next":
        model = random_model(a.tiny)
    else:
        from benchmarks.floors import hf_config
        from jhybrid.config import ModelConfig
        from jhybrid.model_loader import LoadedModel

        cfg = ModelConfig.from_hf(hf_config(a.model, a.tiny))
        model = LoadedModel(cfg=cfg, params=random_params(cfg), tokenizer=None)
    llm = jhybrid.LLM(model, dtype=None, max_num_seqs=max(batches), max_model_len=512, max_num_batched_tokens=2048,
                      warmup=True)
    eng, runner = llm.engine, llm.engine.runner
    vocab = model.cfg.vocab_size
    options = dict(temperature=0.0)
    if a.setting == "every":
        from benchmarks.sampling_cost import settings

        options = {k: v for k, v in settings(vocab)["every control"].items() if k != "bad_words"}
    sp = jhybrid.SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, **options)

    def switch(mode: bool) -> None:
        if a.switch == "dispatch_thread":
            runner.dispatch_thread = mode
        else:
            llm_engine.DEFER_POSTPROCESS = mode

    res = {"device": str(jax.devices()[0].device_kind), "switch": a.switch, "model": a.model, "setting": a.setting,
           "rows": []}
    print(f"{res['device']}; {a.model}, {a.setting}; switch {a.switch}")
    print(f"| batch | {a.switch} | decode step ms (median of rounds) | round s | same tokens |")
    print("|---:|---|---:|---:|---|")
    for b in batches:
        prompts = [np.random.default_rng(i).integers(0, vocab, 256).tolist() for i in range(b)]
        steps = {False: [], True: []}
        walls = {False: [], True: []}
        outputs = {}
        run_round(eng, prompts, sp, f"w{b}")  # first touch of this batch's shapes
        for rep in range(a.reps):
            for mode in (False, True):
                switch(mode)
                times, wall, tokens = run_round(eng, prompts, sp, f"{b}-{rep}-{mode}")
                steps[mode].append(float(np.median(times[4:] or times)) * 1e3)
                walls[mode].append(wall)
                outputs.setdefault(mode, tokens)
        same = outputs[False] == outputs[True]
        for mode in (False, True):
            row = {"batch": b, a.switch: mode, "step_ms": steps[mode], "round_s": walls[mode],
                   "same_tokens": same}
            res["rows"].append(row)
            print(f"| {b} | {'on' if mode else 'off'} | {np.median(steps[mode]):.3f} "
                  f"({', '.join(f'{x:.2f}' for x in steps[mode])}) | {np.median(walls[mode]):.3f} | {same} |",
                  flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=2)
    switch(True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
