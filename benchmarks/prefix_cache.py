"""What prefix caching saves end to end (issue 21), through the public `jhybrid.LLM` API, cache off vs on in one
process (the off engine is the same-run baseline).

    PYTHONPATH=. python -m benchmarks.prefix_cache [--system 2000] [--requests 32] [--json out.json]
    PYTHONPATH=. python -m benchmarks.prefix_cache --tiny          # CPU smoke test

The 2.2 B Qwen3-Next-shaped dense hybrid of benchmarks/generate.py (Gated DeltaNet + full attention, random bf16
weights made on the device, its 151,936-token vocabulary). Two workloads, each run on a warmed-up engine with
the cache off and then on (the engines are built one after the other, the first deleted):

- **shared system prompt**: one request with a `--system`-token system prompt seeds the cache, then
  `--requests` requests share it, each with its own 64-token user turn (greedy, 32 new tokens), all at once.
- **next turn**: `--requests` conversations of a 1,024-token first turn (64 new tokens); then each
  conversation's second turn (the first turn, its answer and 64 new tokens; 32 new tokens), all at once.

Printed per workload: wall seconds of the timed batch (the seeding request or first turn is not timed), prompt
tokens reused from the cache (the engine's `num_cached_tokens`), and how many of the greedy outputs equal the
cache-off outputs token for token (bf16: the cached run prefills other chunks, so a near tie can flip a token;
the CPU tests prove exactness in fp32), and programs compiled after warm-up (expected 0).
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np

from benchmarks.decode_step import random_model


def workloads(vocab: int, system: int, requests: int):
    """name -> (untimed prompts, a function of their outputs -> the timed prompts, timed max_tokens)."""
    rng = np.random.default_rng(0)

    def toks(n):
        return rng.integers(0, vocab, n).tolist()

    sys_prompt = toks(system)
    seed_prompt = sys_prompt + toks(64)
    users = [sys_prompt + toks(64) for _ in range(requests)]
    first_turns = [toks(1024) for _ in range(requests)]
    follow_ups = [toks(64) for _ in range(requests)]
    return {
        "shared system prompt": ([seed_prompt], 32, lambda outs: users, 32),
        "next turn": (first_turns, 64,
                      lambda outs: [p + list(o.token_ids) + f for p, o, f in zip(first_turns, outs, follow_ups)], 32),
    }


def run(llm, untimed, untimed_tokens, timed_of, timed_tokens, sp_cls):
    first = llm.generate(untimed, sp_cls(max_tokens=untimed_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    prompts = timed_of(first)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp_cls(max_tokens=timed_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    secs = time.perf_counter() - t0
    return secs, outs, sum(len(p) for p in prompts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", type=int, default=2000, help="system prompt tokens")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test of this script)")
    args = parser.parse_args(argv)

    import jax

    import jhybrid

    if args.tiny:
        args.system, args.requests = min(args.system, 200), min(args.requests, 4)
    model = random_model(args.tiny)
    cfg = model.cfg
    shapes = dict(dtype=None, max_num_seqs=args.requests, max_model_len=4096, max_num_batched_tokens=4096,
                  gpu_memory_utilization=0.5, warmup=True)
    res = {"device": str(jax.devices()[0].device_kind), "system": args.system, "requests": args.requests, "runs": {}}
    outputs = {}
    for cached in (False, True):
        t0 = time.perf_counter()
        llm = jhybrid.LLM(model, **shapes, enable_prefix_caching=cached)
        print(f"engine (prefix caching {'on' if cached else 'off'}) ready in {time.perf_counter() - t0:.1f} s",
              flush=True)
        for name, (untimed, untimed_tokens, timed_of, timed_tokens) in workloads(cfg.vocab_size, args.system,
                                                                                 args.requests).items():
            secs, outs, prompt_tokens = run(llm, untimed, untimed_tokens, timed_of, timed_tokens, jhybrid.SamplingParams)
            reused = sum(o.num_cached_tokens or 0 for o in outs)
            outputs[name, cached] = [list(o.token_ids) for o in outs]
            res["runs"][f"{name} / {'on' if cached else 'off'}"] = dict(seconds=secs, prompt_tokens=prompt_tokens,
                                                                       reused_tokens=reused)
            print(f"  {name:22s} {secs:7.3f} s   prompt tokens {prompt_tokens:7d}   reused {reused:7d}", flush=True)
        res[f"compiled_after_warmup_{'on' if cached else 'off'}"] = llm.engine.runner.num_compiled_after_seal
        del llm
        gc.collect()

    print(f"\n{res['device']}: {args.requests} requests, system prompt {args.system} tokens")
    print(f"{'workload':22s} {'off s':>8s} {'on s':>8s} {'speed-up':>9s} {'reused':>8s} {'same output':>12s}")
    for name in workloads(cfg.vocab_size, args.system, args.requests):
        off, on = res["runs"][f"{name} / off"], res["runs"][f"{name} / on"]
        same = sum(a == b for a, b in zip(outputs[name, False], outputs[name, True]))
        res["runs"][f"{name} / on"]["same_output"] = same
        print(f"{name:22s} {off['seconds']:8.3f} {on['seconds']:8.3f} {off['seconds'] / on['seconds']:8.2f}x "
              f"{on['reused_tokens'] / on['prompt_tokens']:8.1%} {same:5d} / {len(outputs[name, True]):<5d}")
    print(f"programs compiled after warm-up: off {res['compiled_after_warmup_off']}, "
          f"on {res['compiled_after_warmup_on']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
