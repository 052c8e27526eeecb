"""Start-up compilation of the engine: how long `LLMEngine.warmup` takes to build every step program of the
2.2 B Qwen3-Next-shaped model, cold and with JAX's persistent compilation cache warm, and the decode speed
of the warmed engine.

    PYTHONPATH=. python -m benchmarks.startup [--threads 1,8] [--max-num-seqs 64] [--json out.json]

Each configuration runs in a fresh process (`--child`): the first with an empty cache folder per thread count
(cold), then again over the same folder (cached). Random bf16 weights are made on the device (vocab 4096,
as `benchmarks.serve_gpu` serves). Reported per run: programs compiled or loaded (JAX's compile event),
step programs, seconds of tracing, seconds of the whole warm-up, and, once, the engine's batch-64 decode
step after warm-up (64 prompts of 300 tokens, 64 new tokens, greedy, EOS ignored) with a check that no
program compiled after warm-up, and the time of one step of each program (dummy rows on the null slot).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(args) -> dict:
    import jax
    import numpy as np

    from benchmarks.decode_step import decode_step_times, random_params
    from benchmarks.generate import HF_CONFIG
    from jhybrid.config import ModelConfig
    from jhybrid.engine.compilation import enable_compilation_cache
    from jhybrid.model_loader import LoadedModel
    from jhybrid.engine.llm_engine import LLMEngine
    from jhybrid.engine.sampling import SamplingParams

    enable_compilation_cache(args.cache_dir)
    hf = dict(HF_CONFIG, model_type="qwen3_next", dtype="bfloat16", vocab_size=args.vocab)
    if args.tiny:
        hf.update(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)
    cfg = ModelConfig.from_hf(hf)
    params = random_params(cfg)
    jax.block_until_ready(params)
    eng = LLMEngine(LoadedModel(cfg=cfg, params=params), max_num_seqs=args.max_num_seqs, max_model_len=2048)
    t0 = time.perf_counter()
    step_programs = eng.warmup(progress=False, threads=args.threads)
    warm_s = time.perf_counter() - t0
    st = eng.stats()
    res = dict(threads=args.threads, programs=st["startup_programs_compiled"], step_programs=step_programs,
               lower_s=eng.runner.lower_seconds, warmup_s=warm_s)
    if args.decode:
        program_ms = {}
        for key in eng.runner.program_grid(args.max_num_seqs, eng.scheduler.max_num_batched_tokens):
            times = []
            for _ in range(5):
                t1 = time.perf_counter()
                eng.runner.warm(key)
                times.append(time.perf_counter() - t1)
            program_ms["%s t%d r%d" % ("decode" if key[0] else "mixed", key[1], key[2])] = float(np.median(times)) * 1e3
        res["program_ms"] = program_ms
        rng = np.random.default_rng(0)
        sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        for rep in range(2):
            times = decode_step_times(eng, [rng.integers(1, args.vocab, 300).tolist() for _ in range(64)], sp, str(rep))
        res["decode_step_ms_b64"] = float(np.median(times[4:])) * 1e3
        res["compiled_after_ready"] = eng.stats()["programs_compiled_after_ready"]
        # mixed steps of few rows, outside the grid: what the max_rows padding of mixed steps costs
        extra = [(False, t, 4) for t in (64, 512)]
        eng.runner.compile_all(extra)
        for key in extra:
            times = []
            for _ in range(5):
                t1 = time.perf_counter()
                eng.runner.warm(key)
                times.append(time.perf_counter() - t1)
            program_ms["mixed t%d r%d (not in the grid)" % (key[1], key[2])] = float(np.median(times)) * 1e3
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", default="1,8")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--tiny", action="store_true", help="a small model (CPU check of the script)")
    p.add_argument("--json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    p.add_argument("--decode", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.threads = int(args.threads)
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for threads in [int(t) for t in args.threads.split(",")]:
            cache = os.path.join(tmp, f"cache-{threads}")
            for phase in ("cold", "cached"):
                cmd = [sys.executable, "-m", "benchmarks.startup", "--child", "--threads", str(threads), "--cache-dir",
                       cache, "--max-num-seqs", str(args.max_num_seqs), "--vocab", str(args.vocab)]
                cmd += ["--tiny"] * args.tiny + ["--decode"] * (phase == "cached" and threads == int(args.threads.split(",")[-1]))
                t0 = time.perf_counter()
                out = subprocess.run(cmd, capture_output=True, text=True)
                wall = time.perf_counter() - t0
                line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
                if not line:
                    print(out.stdout[-3000:], out.stderr[-5000:], flush=True)
                    raise SystemExit(f"the {phase} run with {threads} threads failed")
                res = dict(json.loads(line[0][7:]), phase=phase, process_s=wall)
                rows.append(res)
                print(json.dumps(res), flush=True)
    import jax

    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}")
    print(f"{'threads':>7} {'phase':>7} {'programs':>8} {'trace s':>8} {'warmup s':>9} {'process s':>9} {'b64 step ms':>11}")
    for r in rows:
        step = f"{r['decode_step_ms_b64']:.2f}" if "decode_step_ms_b64" in r else "-"
        print(f"{r['threads']:>7} {r['phase']:>7} {r['programs']:>8} {r['lower_s']:>8.1f} {r['warmup_s']:>9.1f} "
              f"{r['process_s']:>9.1f} {step:>11}")
    for r in rows:
        for name, ms in r.get("program_ms", {}).items():
            print(f"  step program {name:>38}: {ms:7.2f} ms (one step, dummy rows, host work and fetch included)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
