"""XLA compile options for the engine's step programs, compared in one process: compile time, and the served
workload's steps and program calls with each option set.

    PYTHONPATH=. python3 -m benchmarks.compile_options \
        --variant xla_gpu_command_buffer_update_mode=SKIP_TEMP --variant xla_gpu_enable_triton_gemm=false \
        [--cap 192] [--rounds 3] [--json out.json]
    PYTHONPATH=. python -m benchmarks.compile_options --tiny --variant xla_gpu_enable_triton_gemm=false \
        --rounds 1 --requests 8          # CPU smoke test (8 sequences; GPU options compile and are ignored there)

Why one process: the batch-1 step moves by 1-2 ms between processes on the H200 (benchmarks/RESULTS.md, session 15),
more than an option is worth. Here one engine (the 2.2 B Qwen3-Next-shaped model of benchmarks/generate.py, random
bf16 weights, vocab 4096 as `benchmarks.serve_gpu` serves; `max_num_seqs=64`, `max_model_len=2048`) compiles its whole
program grid once per variant ("default" first: no options, XLA's defaults, not the engine's; each `--variant` sets
one or more options, `NAME=VALUE[,NAME=VALUE]`), each without the persistent cache, and runs each program once. XLA
keeps the GEMM autotuner's results in the process, so a variant compiled after another that met the same fusions
compiles faster: only the first row's compile seconds are a cold start's (benchmarks.startup times each in a fresh
process). Then `--rounds` rounds of `benchmarks.serve_gpu.closed_loop` (the offline twin of serve_gpu's load:
`--requests` requests of ~300-token random prompts, 64 new tokens, greedy, at most 64 in flight; `--cap` is
`max_prefill_tokens_with_decodes`, 192 by default: the setting whose decode steps change program after runs of mixed
steps) run the same requests with the variants' program tables swapped in turn, the state and weights shared. Tokens
may differ where an option changes the GEMMs' algorithms (bf16 rounding, near-tied logits of random weights). Reported
per variant: compile seconds, output tokens/s, the ITL a client would see (P50/P99), the step intervals (P50/P99/max),
the host time of the step programs' calls (per program: P50/P99/max) and whether the tokens equal the default's.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def parse_variant(text: str) -> dict[str, str | bool | int]:
    """'a=1,b=false' -> {'a': 1, 'b': False}: XLA's debug options take typed values."""
    out: dict[str, str | bool | int] = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("xla_"):
            raise ValueError(f"a variant is NAME=VALUE[,NAME=VALUE] of XLA options (xla_...), got {item!r}")
        low = value.lower()
        if low in ("true", "false"):
            out[name] = low == "true"
        else:
            out[name] = int(value) if value.lstrip("-").isdigit() else value
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", default=[], help="NAME=VALUE[,NAME=VALUE] (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--cap", type=int, default=192, help="max_prefill_tokens_with_decodes (0: none)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test)")
    parser.add_argument("--json")
    a = parser.parse_args(argv)
    variants = {"default": None, **{v: parse_variant(v) for v in a.variant}}

    import jax

    import jhybrid
    from benchmarks.decode_step import random_params
    from benchmarks.generate import HF_CONFIG
    from benchmarks.serve_gpu import TINY_CONFIG, VOCAB, closed_loop
    from jhybrid.config import ModelConfig
    from jhybrid.model_loader import LoadedModel

    hf = dict(HF_CONFIG, model_type="qwen3_next", dtype="bfloat16", vocab_size=VOCAB, **(TINY_CONFIG if a.tiny else {}))
    cfg = ModelConfig.from_hf(hf)
    model = LoadedModel(cfg=cfg, params=random_params(cfg))
    max_model_len = 512 if a.tiny else 2048
    max_num_seqs = 8 if a.tiny else 64
    llm = jhybrid.LLM(model, dtype=None, max_num_seqs=max_num_seqs, max_model_len=max_model_len, warmup=False,
                      max_prefill_tokens_with_decodes=a.cap or None)
    eng, runner = llm.engine, llm.engine.runner
    grid = runner.program_grid(eng.scheduler.max_num_seqs, eng.scheduler.max_num_batched_tokens)
    tables, compile_s = {}, {}
    for name, options in variants.items():
        runner._programs, runner.compiler_options = {}, options
        t0 = time.perf_counter()
        runner.compile_all(grid)
        compile_s[name] = time.perf_counter() - t0
        for key in grid:
            runner.warm(key)
        tables[name] = runner._programs
        print(f"compiled {len(grid)} step programs with {name}: {compile_s[name]:.1f} s", flush=True)
    runner.seal()

    vocab = model.cfg.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, max(8, int(rng.normal(300, 75)))).tolist() for _ in range(a.requests)]
    if a.tiny:
        prompts = [p[:48] for p in prompts]
    sp = jhybrid.SamplingParams(max_tokens=64 if not a.tiny else 16, temperature=0.0, ignore_eos=True)
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    in_flight = min(a.concurrency, max_num_seqs)
    for rep in range(a.rounds):
        for name in variants:
            runner._programs = tables[name]
            runs[name].append(closed_loop(eng, prompts, in_flight, sp, f"{name}-{rep}", trace=True))
    res = {"device": str(jax.devices()[0].device_kind), "grid": len(grid), "cap": a.cap, "variants": {}}
    reference = runs["default"][0]["outputs_sha1"]
    print(f"\n{res['device']}; {len(grid)} step programs; {a.requests} requests x {sp.max_tokens} tokens, "
          f"{in_flight} in flight, prefill cap {a.cap or 'none'}; medians over {a.rounds} rounds")
    print("| variant | compile s | tok/s | ITL p50 / p99 ms | step p50 / p99 / max ms "
          "| busiest program: call p50 / p99 ms | slowest calls ms | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for name, rs in runs.items():
        med = lambda f: float(np.median([f(r) for r in rs]))  # noqa: E731
        steps = [r["steps"]["all"]["interval_ms"] for r in rs]
        calls = [r["calls"] for r in rs]
        top = next(iter(calls[0]["by_program"]), None)
        call = (lambda c: c["by_program"].get(top, {}).get("call_ms", {})) if top else (lambda c: {})
        slow = sorted((x["call_ms"] for c in calls for x in c["slowest"]), reverse=True)[:3]
        row = {"options": variants[name], "compile_s": compile_s[name],
               "tok_s": med(lambda r: r["output_tokens_per_s"]),
               "itl_ms": {q: med(lambda r: r["itl_s"][q] * 1e3) for q in ("p50", "p99")},
               "step_ms": {q: float(np.median([s[q] for s in steps])) for q in ("p50", "p99", "max")},
               "busiest_program": top,
               "call_ms": {q: float(np.median([call(c).get(q, float("nan")) for c in calls])) for q in ("p50", "p99")},
               "slowest_calls_ms": slow, "same_tokens": all(r["outputs_sha1"] == reference for r in rs), "runs": rs}
        res["variants"][name] = row
        print(f"| {name} | {row['compile_s']:.1f} | {row['tok_s']:.1f} | {row['itl_ms']['p50']:.2f} / "
              f"{row['itl_ms']['p99']:.2f} | {row['step_ms']['p50']:.2f} / {row['step_ms']['p99']:.2f} / "
              f"{row['step_ms']['max']:.1f} | {top}: {row['call_ms']['p50']:.2f} / {row['call_ms']['p99']:.2f} | "
              f"{', '.join(f'{x:.1f}' for x in slow)} | {row['same_tokens']} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
