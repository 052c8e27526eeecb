"""Where batch-1 decode time goes: the jitted step timed three ways, and its kernel count.

    PYTHONPATH=. python -m benchmarks.decode_step [--json out.json]

On the 2.2 B Qwen3-Next-shaped dense model (random bf16 weights made on the device), after a 512-token
prefill: (a) `SequenceRunner.step` (host batch building + dispatch), (b) the jitted forward called
back to back on device-resident inputs (dispatch + device only), (c) the number of kernels (fusions,
custom calls, library calls) in the compiled program. Run it under different XLA_FLAGS to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.generate import HF_CONFIG
from jhybrid.config import ModelConfig
from jhybrid.models.batch import RowSpec, make_batch
from jhybrid.models.params import flatten_shapes, pack_params, param_shapes, unflatten
from tests.runner_helpers import SequenceRunner, _step


def random_params(cfg: ModelConfig, seed: int = 0):
    key = jax.random.key(seed)
    flat = {}
    for i, (name, shape) in enumerate(flatten_shapes(param_shapes(cfg)).items()):
        k = jax.random.fold_in(key, i)
        if name.endswith("A_log"):
            flat[name] = jnp.log(jax.random.uniform(k, shape, jnp.float32, 1.0, 16.0))
        elif name.endswith("dt_bias"):
            flat[name] = jax.random.uniform(k, shape, jnp.float32, -1.0, 1.0)
        else:
            flat[name] = (jax.random.normal(k, shape, jnp.float32) * (0.05 if len(shape) == 1 else 0.02)).astype(jnp.bfloat16)
    return pack_params(unflatten(flat, cfg))


def random_model(tiny: bool = False, tokenizer=None, max_position_embeddings: int | None = None,
                 overrides: dict | None = None):
    """The 2.2 B Qwen3-Next-shaped dense hybrid of benchmarks/generate.py (bf16, its full vocabulary) as a
    `LoadedModel` with random weights made on the device; `tiny`: benchmarks/serve_gpu.py's toy config with
    vocab 4096 (CPU smoke tests of the scripts); `max_position_embeddings` raises the config's 4096 for
    long-context benchmarks (RoPE's tables are computed, not stored: nothing else changes); `overrides`: HF config
    fields replaced (e.g. `MOE_OVERRIDES`)."""
    from jhybrid.model_loader import LoadedModel

    hf = dict(HF_CONFIG, model_type="qwen3_next", dtype="bfloat16")
    if tiny:
        from benchmarks.serve_gpu import TINY_CONFIG

        hf.update(TINY_CONFIG, vocab_size=4096)
    hf.update(overrides or {})
    if max_position_embeddings:
        hf["max_position_embeddings"] = max(hf["max_position_embeddings"], max_position_embeddings)
    cfg = ModelConfig.from_hf(hf)
    return LoadedModel(cfg=cfg, params=random_params(cfg), tokenizer=tokenizer)


def count_kernels(hlo_text: str) -> dict[str, int]:
    entry = hlo_text[hlo_text.index("ENTRY") :]
    return {
        "fusion": len(re.findall(r"= \S+ fusion\(", entry)),
        "custom-call": len(re.findall(r"custom-call\(", entry)),
        "while": len(re.findall(r" while\(", entry)),
        "instructions": entry.count("\n"),
    }


def decode_step_times(eng, prompts, sp, tag: str) -> list[float]:
    """Runs `prompts` through the engine to the end; returns the wall time of each step in which every row
    decoded (the engine dispatches a step before reading the last, so in steady state: the device step plus
    any host time not hidden behind it), per token of a row: a multi-step engine's (`num_scheduler_steps`) call
    reads several tokens of each row, and its time is divided by them."""
    return run_round(eng, prompts, sp, tag)[0]


def run_round(eng, prompts, sp, tag: str) -> tuple[list[float], float, list[list[int]]]:
    """`decode_step_times`, with the wall time of the whole round (prefill included) and each request's output
    tokens."""
    t_start = time.perf_counter()
    seqs = [eng.add_request(f"{tag}-{i}", prompt, sp) for i, prompt in enumerate(prompts)]
    times, last = [], None
    while eng.has_unfinished():
        decode_only = all(s.num_uncomputed <= 1 for s in eng.scheduler.running) and not eng.scheduler.waiting
        running = [s for s in seqs if not s.is_finished]
        before = sum(len(s.token_ids) for s in running)
        eng.step()
        now = time.perf_counter()
        per_row = (sum(len(s.token_ids) for s in running) - before) / max(len(running), 1)
        if decode_only and last is not None and per_row > 0:
            times.append((now - last) / max(per_row, 1.0))
        last = now
    wall = time.perf_counter() - t_start
    tokens = [list(eng.requests[f"{tag}-{i}"].output_ids) for i in range(len(prompts))]
    for i in range(len(prompts)):
        eng.release(f"{tag}-{i}")
    return times, wall, tokens


def engine_decode(cfg, params, batches, json_path):
    """Steady-state decode step time of the LLM engine (host work + dispatch + device), prompts of 512."""
    import jhybrid
    from jhybrid.model_loader import LoadedModel

    llm = jhybrid.LLM(LoadedModel(cfg=cfg, params=params), dtype=None, max_num_seqs=max(batches), max_model_len=1024,
                      max_num_batched_tokens=8192)
    eng, res = llm.engine, {}
    sp = jhybrid.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for b in batches:
        compiled = eng.runner.compile_seconds
        for rep in range(2):  # the first compiles
            times = decode_step_times(eng, [[t % cfg.vocab_size for t in range(1, 513)]] * b, sp, f"{b}-{rep}")
        res[f"engine_decode_step_ms_b{b}"] = float(np.median(times[4:])) * 1e3
        res[f"compile_s_b{b}"] = eng.runner.compile_seconds - compiled  # this batch's new programs (prefill too)
        print(f"engine batch {b}: decode step {res[f'engine_decode_step_ms_b{b}']:.3f} ms (programs compiled for "
              f"it: {res[f'compile_s_b{b}']:.1f} s)", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=2)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--engine", default="", help="comma-separated batch sizes: time the LLM engine's decode steps only")
    args = parser.parse_args(argv)
    hf = dict(HF_CONFIG, model_type="qwen3_next", dtype="bfloat16")
    cfg = ModelConfig.from_hf(hf)
    params = random_params(cfg)
    if args.engine:
        return engine_decode(cfg, params, [int(b) for b in args.engine.split(",")], args.json)
    runner = SequenceRunner(cfg, params, max_len=1024)
    table, slot = runner.start()
    jax.block_until_ready(runner.step(list(range(512)), 0, table, slot))
    for i in range(4):
        out = runner.step([1], 512 + i, table, slot)
    jax.block_until_ready(out)
    # (a) through SequenceRunner.step
    t0 = time.perf_counter()
    for i in range(args.steps):
        out = runner.step([1], 516 + i, table, slot)
    jax.block_until_ready(out)
    a = (time.perf_counter() - t0) / args.steps * 1e3
    # (b) the jitted forward on device-resident inputs, back to back
    batch = jax.tree.map(jnp.asarray, make_batch([RowSpec([1], 700, table, slot)], block_size=runner.block_size,
                                                 max_blocks_per_seq=runner.max_blocks, num_tokens=1, num_rows=1))
    state = runner.state
    for _ in range(3):
        logits, state = _step(cfg, runner.params, state, batch, decode=True, all_logits=False, kernel_impl="auto", interpret=False)
    jax.block_until_ready(logits)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        logits, state = _step(cfg, runner.params, state, batch, decode=True, all_logits=False, kernel_impl="auto", interpret=False)
    jax.block_until_ready(logits)
    b = (time.perf_counter() - t0) / args.steps * 1e3
    # (c) dispatch alone: a trivial jitted function with the same argument pytree
    touch = jax.jit(lambda p, s, bt: bt.token_ids + 1)
    jax.block_until_ready(touch(runner.params, state, batch))
    t0 = time.perf_counter()
    for _ in range(args.steps):
        r = touch(runner.params, state, batch)
    jax.block_until_ready(r)
    c = (time.perf_counter() - t0) / args.steps * 1e3
    hlo = _step.lower(cfg, runner.params, state, batch, decode=True, all_logits=False, kernel_impl="auto",
                      interpret=False).compile().as_text()
    kernels = count_kernels(hlo)
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(runner.params))
    res = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "runner_step_ms": a, "jit_step_ms": b, "dispatch_only_ms": c,
           "kernels": kernels, "weight_bytes": weight_bytes}
    print(json.dumps(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
