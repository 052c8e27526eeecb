"""Multi-step decode (`num_scheduler_steps`) against single steps, in one process: `LLM.generate`'s decode time
per token at small batches (issue 20's batch-1 rows).

    PYTHONPATH=. python3 -m benchmarks.multi_step [--models qwen3_next,nemotron_h,minimax] [--batches 1,4,8]
        [--steps 1,4,8] [--reps 3] [--json out.json] [--tiny]

For each model of `benchmarks.floors` (random bf16 weights made on the device), one engine with room for 8
sequences: rounds of greedy requests (512-token prompts, 128 new tokens, ignore_eos) at each batch, alternating the
engine's decode steps per program (`--steps`, switched in place: the same engine, weights and programs; the first
round of each setting compiles and is not timed). Before timing, each setting's greedy tokens are checked against
single steps' (`--steps` 1 first). Reported: the median per-token time of the decode-only engine steps
(`benchmarks.decode_step.decode_step_times`: a multi-step call's time divided by the tokens it read per row), the
median over `--reps` rounds, beside the bytes floor of `floors` (the weights a token reads, the fp32 state read and
written, the KV) at the read bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json

import numpy as np


def log(*a):
    print(*a, flush=True)


def one_model(name: str, args) -> dict:
    import jax

    import jhybrid
    from benchmarks.decode_step import decode_step_times, random_params, run_round
    from benchmarks.floors import byte_counts, hf_config, read_bandwidth
    from jhybrid.config import ModelConfig
    from jhybrid.model_loader import LoadedModel
    from jhybrid.models.params import flatten_shapes, param_shapes

    cfg = ModelConfig.from_hf(hf_config(name, args.tiny))
    counts = byte_counts(cfg, flatten_shapes(param_shapes(cfg)))
    bw = read_bandwidth(args.tiny)
    prompt, new = (32, 16) if args.tiny else (512, 128)
    model = LoadedModel(cfg=cfg, params=random_params(cfg), tokenizer=None)
    jax.block_until_ready(model.params)
    batches = [int(b) for b in args.batches.split(",")]
    settings = [int(k) for k in args.steps.split(",")]
    llm = jhybrid.LLM(model, dtype=None, max_num_seqs=max(batches), max_model_len=prompt + new + 16,
                      max_num_batched_tokens=64 if args.tiny else 2048, num_scheduler_steps=max(settings))
    eng = llm.engine
    sp = jhybrid.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    experts = counts["experts"] * (counts["top_k"] / counts["num_experts"] if counts["num_experts"] else 1)
    row = dict(model=name, read_tbps=bw / 1e12, results=[])
    for b in batches:
        prompts = [[(7 * r + t) % cfg.vocab_size for t in range(1, prompt + 1)] for r in range(b)]
        floor = (counts["dense"] + experts + b * (2 * counts["state"] + counts["kv_per_token"] * (prompt + new / 2)))
        floor_ms = floor / bw * 1e3
        reference = None
        for k in settings:  # compile, and check the tokens against single steps'
            eng.scheduler.num_scheduler_steps = eng.runner.burst_steps = k
            tokens = run_round(eng, prompts, sp, f"check-{b}-{k}")[2]
            if reference is None:
                reference = tokens
            agree = tokens == reference
            log(f"[{name}] batch {b}, {k} steps per program: tokens {'equal' if agree else 'DIFFER'} to single steps'")
            if not agree:
                row["results"].append(dict(batch=b, steps=k, error="tokens differ from single steps'"))
        times, calls = {k: [] for k in settings}, {k: 0 for k in settings}
        for rep in range(args.reps):
            for k in settings:
                eng.scheduler.num_scheduler_steps = eng.runner.burst_steps = k
                bursts = eng.runner.num_bursts
                t = decode_step_times(eng, prompts, sp, f"{b}-{k}-{rep}")
                times[k].append(float(np.median(t[4:] if len(t) > 8 else t)) * 1e3)
                calls[k] += eng.runner.num_bursts - bursts
                if k > 1 and eng.runner.num_bursts == bursts:
                    log(f"[{name}] batch {b}: no multi-step program ran with {k} steps")
        for k in settings:
            ms = float(np.median(times[k]))
            row["results"].append(dict(batch=b, steps=k, ms_per_token=ms, rounds=times[k], floor_ms=floor_ms,
                                       ratio=ms / floor_ms, multi_step_calls=calls[k]))
            log(f"[{name}] batch {b}, {k} steps per program: {ms:.3f} ms per token (rounds "
                f"{', '.join(f'{x:.3f}' for x in times[k])}); floor {floor_ms:.3f} ms: {ms / floor_ms:.2f}x")
    del llm, eng, model
    gc.collect()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3_next,nemotron_h,minimax", help="comma-separated, from benchmarks.floors")
    ap.add_argument("--batches", default="1,4,8", help="sequences decoding at once (at most 8: MULTI_STEP_MAX_ROWS)")
    ap.add_argument("--steps", default="1,4,8", help="decode steps per program to compare; the first is the baseline")
    ap.add_argument("--reps", type=int, default=3, help="timed rounds per setting, interleaved")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true", help="the floors' tiny configs (a CPU check of the script)")
    args = ap.parse_args(argv)
    rows = []
    for name in filter(None, args.models.split(",")):
        rows.append(one_model(name, args))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    settings = [int(k) for k in args.steps.split(",")]
    log("\n| model | batch | floor ms | " + " | ".join(f"{k} steps: ms/token (x floor)" for k in settings) + " |")
    log("|---|---:|---:|" + "---:|" * len(settings))
    for r in rows:
        by = {(x["batch"], x["steps"]): x for x in r["results"] if "ms_per_token" in x}
        for b in sorted({x["batch"] for x in r["results"]}):
            cells = [f"{by[b, k]['ms_per_token']:.3f} ({by[b, k]['ratio']:.2f}x)" if (b, k) in by else "-"
                     for k in settings]
            floor = next((x["floor_ms"] for x in r["results"] if x["batch"] == b and "floor_ms" in x), float("nan"))
            log(f"| {r['model']} | {b} | {floor:.3f} | " + " | ".join(cells) + " |")
    bad = [x for r in rows for x in r["results"] if "error" in x]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
