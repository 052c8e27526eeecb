"""Does a `lax.cond` in a step program make the host wait for the device? (issues 16, 19)

    PYTHONPATH=. python -m benchmarks.cond_dispatch [--json out.json] [--batches 1,64]
    XLA_FLAGS=--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE PYTHONPATH=. python -m benchmarks.cond_dispatch
    PYTHONPATH=. python -m benchmarks.cond_dispatch --tiny --batches 2          # CPU smoke test

XLA:GPU runs a `conditional` outside its CUDA graphs unless CONDITIONAL is among the command buffer types
(`--xla_gpu_enable_command_buffer`): it copies the predicate to the host and waits for it, so the call of a
program holding a cond returns only when the device has reached the cond. The engine's sampler has several;
the engine dispatches step N+1 before it reads step N, which only helps if the call returns at once.

Three measurements, each a median over repeated calls: (1) a synthetic program (a chain of matmuls, with and
without a cond after them): the time until the call returns against the time until its result is ready;
(2) `jhybrid.engine.sampling.sample` at a decode step's shape; (3) the offline engine (the 2.2 B model of
benchmarks/generate.py, random weights, full vocabulary): the wall time of each all-decode step and the time the
step program's call takes to return, greedy and sampled. Run it once with the default flags and once with the
flags under test; the flags in effect are printed and saved.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import numpy as np


def call_and_ready(fn, args, iters: int) -> tuple[float, float]:
    """Median ms until `fn(*args)` returns, and until its result is ready."""
    import jax

    jax.block_until_ready(fn(*args))
    calls, readies = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = fn(*args)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        calls.append(t1 - t0)
        readies.append(t2 - t0)
    return float(np.median(calls)) * 1e3, float(np.median(readies)) * 1e3


def synthetic(iters: int, size: int, depth: int) -> dict:
    import jax
    import jax.numpy as jnp

    w = jax.random.normal(jax.random.key(0), (size, size), jnp.float32) / np.sqrt(size)
    x = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)

    def chain(x):
        for _ in range(depth):
            x = jnp.tanh(x @ w)
        return x

    plain = jax.jit(lambda x, p: chain(x) * 2.0)
    with_cond = jax.jit(lambda x, p: jax.lax.cond(p > 0, lambda y: y * 2.0, lambda y: y, chain(x)))
    p = jnp.int32(1)
    out = {}
    for name, fn in (("matmul chain", plain), ("matmul chain + cond", with_cond)):
        text = fn.lower(x, p).compile().as_text()
        call, ready = call_and_ready(fn, (x, p), iters)
        out[name] = {"call_ms": call, "ready_ms": ready, "conditionals": text.count(" conditional(")}
    return out


def sampler(iters: int, batch: int, vocab: int) -> dict:
    import jax
    import jax.numpy as jnp

    from benchmarks.sampler_kernels import sampling_arrays
    from jhybrid.engine import sampling
    from jhybrid.engine.slot_tables import init_tables

    logits = jax.random.normal(jax.random.key(0), (batch, vocab), jnp.float32) * 4.0
    tables, history = init_tables(batch + 1, vocab)

    fn = jax.jit(sampling.sample)
    out = {}
    for name, t in (("sample() greedy", 0.0), ("sample() temperature, top-k, top-p", 0.8)):
        call, ready = call_and_ready(fn, (logits, sampling_arrays(batch, t), tables, history), iters)
        out[name] = {"call_ms": call, "ready_ms": ready}
    return out


def engine(batches: list[int], tiny: bool) -> dict:
    import jhybrid
    from benchmarks.decode_step import decode_step_times, random_model

    model = random_model(tiny)
    llm = jhybrid.LLM(model, dtype=None, max_num_seqs=max(batches), max_model_len=512, max_num_batched_tokens=2048,
                      warmup=True)
    eng = llm.engine
    runner = eng.runner
    calls: list[float] = []
    original = runner._program

    def timed_program(*key):
        program = original(*key)

        def call(*a, **k):
            t0 = time.perf_counter()
            r = program(*a, **k)
            calls.append(time.perf_counter() - t0)
            return r

        return call

    runner._program = timed_program
    text = runner._programs[max(k for k in runner._programs if k[0])].as_text()  # the largest decode program
    out = {"conditionals in the decode program": text.count(" conditional("),
           "whiles in the decode program": text.count(" while(")}
    vocab = model.cfg.vocab_size
    for b in batches:
        prompts = [np.random.default_rng(i).integers(0, vocab, 256).tolist() for i in range(b)]
        for name, kw in (("greedy", dict(temperature=0.0)),
                         ("sampled", dict(temperature=0.8, top_k=50, top_p=0.9, seed=1))):
            sp = jhybrid.SamplingParams(max_tokens=64, ignore_eos=True, **kw)
            for rep in range(2):
                calls.clear()
                times = decode_step_times(eng, prompts, sp, f"{b}-{name}-{rep}")
            out[f"batch {b} {name}"] = {"step_ms": float(np.median(times[4:])) * 1e3,
                                        "program_call_ms": float(np.median(calls[4:])) * 1e3}
            print(f"  engine batch {b} {name}: {out[f'batch {b} {name}']}", flush=True)
    out["compiled_after_warmup"] = runner.num_compiled_after_seal
    # the same greedy tokens under every flag set (compare the runs' hashes: flags must not change results)
    prompts = [np.random.default_rng(100 + i).integers(0, vocab, 64 + 37 * i).tolist() for i in range(4)]
    done = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        jhybrid.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    tokens = [list(o.outputs[0].token_ids) for o in done]
    out["greedy_tokens_sha1"] = hashlib.sha1(json.dumps(tokens).encode()).hexdigest()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--batches", default="1,64", help="engine batch sizes (comma-separated)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--tiny", action="store_true", help="small shapes and a tiny model (CPU smoke test)")
    parser.add_argument("--skip-engine", action="store_true")
    a = parser.parse_args(argv)

    import jax

    res = {"device": str(jax.devices()[0].device_kind), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    print(f"{res['device']}; XLA_FLAGS={res['xla_flags']!r}", flush=True)
    res["synthetic"] = synthetic(a.iters, 256 if a.tiny else 1024, 8 if a.tiny else 64)
    res["sampler"] = sampler(a.iters, 4 if a.tiny else 64, 4096 if a.tiny else 151936)
    for part in ("synthetic", "sampler"):
        for name, r in res[part].items():
            print(f"  {name:40s} call returns {r['call_ms']:8.3f} ms, result ready {r['ready_ms']:8.3f} ms"
                  + (f" ({r['conditionals']} conditionals)" if "conditionals" in r else ""), flush=True)
    def save():  # after each part: the kernel figures survive an engine part that fails or runs out of time
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=2)

    save()
    if not a.skip_engine:
        res["engine"] = engine([int(b) for b in a.batches.split(",")], a.tiny)
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
