"""Routed experts on the GPU: grouped by expert (the Pallas grouped matmul) against every expert on every token (the
dense einsums the MoE layer ran before), bf16 and FP8, the layer alone and the engine end to end, in one run.

    PYTHONPATH=. python -m benchmarks.moe [--json out.json] [--tokens 1,8,64,256,2048,8192] [--skip-engine]

1. Layer: `jhybrid.models.layers.routed_experts_grouped` and `routed_experts_dense` on random routing (each token
   k distinct experts, uniform), for each shape in `SHAPES` and token count. Each is first checked against the dense
   path on the GPU (relative error), then timed; every timed call runs `LAYERS` different weight stacks (as a
   model's layers do), so weights stream from memory; ms are per layer. The floor is the larger of the bytes the
   grouped path must read (the experts the routing touches, once, at the copy bandwidth measured here) and its
   FLOPs at the H200's dense bf16 peak (989 TFLOP/s). A sweep of the kernel's tiles (`SWEEP`) runs at each count.
2. Engine: the 2.2 B model with every MLP a Qwen3-Next MoE (`benchmarks.fp8.MOE_OVERRIDES`: 64 experts of 512, top-8,
   a shared expert) in `jhybrid.LLM`, `MOE_IMPL` "dense" against "grouped", bf16 and FP8: the decode step at batch 1
   and 64 (512-token prompts) and a 16 x 1024-token prefill.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.generate import copy_bandwidth, log, machine_info
from benchmarks.kernels import errors, time_jax
from jhybrid.models import layers
from jhybrid.models.quant import Fp8Weight, quantize_weight_tree
from pallas_kernels.grouped_matmul import default_block_m

LAYERS = 4
PEAK_BF16 = 989e12  # H200 dense bf16 tensor-core FLOP/s (NVIDIA's figure, no sparsity)
# (name, experts, top-k, hidden, expert intermediate)
# ("minimax-bench": `benchmarks.floors`' MiniMax-shaped model, 32 experts of 512, top-2)
SHAPES = [("bench-moe", 64, 8, 2048, 512), ("qwen3-next-80b", 512, 10, 2048, 512), ("minimax-bench", 32, 2, 2048, 512)]
# kernel tiles tried at each token count: (block_m or None for the default, block_n, block_k, num_warps, num_stages,
# split_k). The split-K tiles are for steps of few tiles (a batch-1 token's 2 experts: 2 x N_out / BN programs
# unsplit); `grouped_matmul` shrinks split_k to divide K's blocks
SWEEP = [(None, 32, 64, 4, 3, 1), (None, 64, 64, 4, 3, 1), (None, 32, 128, 4, 3, 1), (None, 64, 128, 4, 4, 1),
         (None, 128, 64, 8, 3, 1), (None, 16, 128, 4, 3, 1), (None, 16, 128, 4, 4, 1), (32, 64, 64, 4, 3, 1),
         (64, 64, 64, 4, 3, 1), (128, 128, 64, 8, 3, 1), (64, 128, 64, 4, 3, 1), (None, 16, 128, 4, 4, 4),
         (None, 32, 128, 4, 4, 8), (None, 64, 128, 4, 4, 16), (None, 64, 64, 4, 3, 16), (None, 32, 128, 4, 4, 4),
         (None, 64, 128, 4, 4, 4), (None, 64, 128, 4, 4, 8), (None, 64, 64, 4, 3, 8), (None, 32, 64, 4, 3, 16)]
TINY_SHAPES = [("tiny", 8, 2, 128, 128)]  # `--tiny`: a CPU smoke run of the script (kernels interpreted)
INTERPRET = jax.default_backend() == "cpu"
DENSE_MAX_ELEMS = 2**31  # the dense path's [T, E, 2 Ie] intermediate, above which it is not run


def routing(rng, num_tokens: int, num_experts: int, k: int):
    top_i = np.argsort(rng.random((num_tokens, num_experts)), axis=1)[:, :k]  # k distinct experts a token
    top_p = rng.uniform(0.05, 1.0, (num_tokens, k))
    return jnp.asarray(top_i, jnp.int32), jnp.asarray(top_p / top_p.sum(1, keepdims=True), jnp.float32)


def expert_stacks(e: int, d: int, ie: int, fp8: bool, seed: int):
    key = jax.random.key(seed)
    w_in = (jax.random.normal(key, (e, d, 2 * ie), jnp.float32) * d ** -0.5).astype(jnp.bfloat16)
    w_down = (jax.random.normal(jax.random.fold_in(key, 1), (e, ie, d), jnp.float32) * ie ** -0.5).astype(jnp.bfloat16)
    if fp8:
        return quantize_weight_tree(w_in), quantize_weight_tree(w_down)
    return w_in, w_down


def _stack_bytes(w) -> int:
    return sum(a.nbytes for a in jax.tree_util.tree_leaves(w))


def floor_ms(top_i, e, d, ie, k, per_expert_bytes: float, bandwidth: float) -> float:
    touched = len(np.unique(np.asarray(top_i)))
    t = top_i.shape[0]
    bytes_ = touched * per_expert_bytes + 2 * t * d * 2  # the experts read once, x read and out written (bf16)
    flops = 2 * t * k * d * 3 * ie
    return max(bytes_ / bandwidth, flops / PEAK_BF16) * 1e3


def bench_layer(tokens: list[int], bandwidth: float, sweep: bool, budget_s: float, shapes=SHAPES,
                forms=(False, True)) -> list[dict]:
    rows = []
    t_start = time.perf_counter()
    for name, e, k, d, ie in shapes:
        for fp8 in forms:
            stacks = [expert_stacks(e, d, ie, fp8, seed) for seed in range(LAYERS)]
            per_expert = (_stack_bytes(stacks[0][0]) + _stack_bytes(stacks[0][1])) / e
            rng = np.random.default_rng(0)
            for t in tokens:
                x = jnp.asarray(rng.standard_normal((t, d)) * 0.5, jnp.bfloat16)
                top_i, top_p = routing(rng, t, e, k)

                def run(fn):
                    def many(x, top_i, top_p, stacks):
                        out = x
                        for w_in, w_down in stacks:
                            out = fn(out, top_i, top_p, w_in, w_down, "silu") + x
                        return out
                    return jax.jit(many)

                grouped = run(functools.partial(layers.routed_experts_grouped, impl="pallas", interpret=INTERPRET))
                dense_ok = t * e * 2 * ie <= DENSE_MAX_ELEMS
                row = dict(shape=name, E=e, k=k, D=d, Ie=ie, fp8=fp8, tokens=t, block_m=default_block_m(t * k, e),
                           floor_ms=floor_ms(top_i, e, d, ie, k, per_expert, bandwidth))
                got = jax.jit(lambda *a: layers.routed_experts_grouped(*a, "silu", impl="pallas", interpret=INTERPRET))(
                    x, top_i, top_p, *stacks[0])
                if dense_ok:
                    want = jax.jit(lambda *a: layers.routed_experts_dense(*a, "silu"))(x, top_i, top_p, *stacks[0])
                    row["max_abs_err"], row["rel_err"] = errors(got.astype(jnp.float32), want.astype(jnp.float32))
                    row["dense_ms"] = time_jax(run(layers.routed_experts_dense), (x, top_i, top_p, stacks))[0] / LAYERS
                row["grouped_ms"] = time_jax(grouped, (x, top_i, top_p, stacks))[0] / LAYERS
                if sweep and time.perf_counter() - t_start < budget_s:
                    best = (row["grouped_ms"], "default")
                    row["sweep"] = {}
                    for bm, bn, bk, warps, stages, split_k in SWEEP:
                        if fp8 and (128 % bn or 128 % bk) or split_k > 1 and t > 4:  # split K: few tiles only
                            continue
                        cfg = dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, split_k=split_k)
                        try:
                            fn = functools.partial(_grouped_with, cfg=cfg, block_m=bm)
                            mine = jax.jit(lambda *a, f=fn: f(*a, "silu"))(x, top_i, top_p, *stacks[0])
                            err = errors(mine.astype(jnp.float32), got.astype(jnp.float32))[1]
                            if not err <= 1e-2:  # each tiling checked against the default's output first
                                log(f"   {name} T{t} {bm} {cfg}: WRONG, rel err {err:.2e} from the default tiles")
                                continue
                            ms = time_jax(run(fn), (x, top_i, top_p, stacks), reps=10)[0] / LAYERS
                        except Exception as exc:  # a tile that does not fit (shared memory): reported, skipped
                            log(f"   {name} T{t} {bm} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                            continue
                        tiles = (f"bm{bm or row['block_m']} bn{bn} bk{bk} w{warps} s{stages}"
                                 + (f" sk{split_k}" if split_k > 1 else ""))
                        row["sweep"][tiles] = ms
                        best = min(best, (ms, tiles))
                    row["best_ms"], row["best_config"] = best
                rows.append(row)
                log(json.dumps(row))
            del stacks
            gc.collect()
    return rows


def _grouped_with(x, top_i, top_p, w_in, w_down, act, *, cfg, block_m):
    """The grouped layer with the kernel's tiles `cfg` (and rows per tile `block_m`, None: the default)."""
    from pallas_kernels import grouped_matmul as gm

    saved_tuning, saved_bm = gm.default_tuning, layers.default_block_m
    gm.default_tuning = lambda *a: dict(cfg)
    if block_m:
        layers.default_block_m = lambda p, e: block_m
    try:
        return layers.routed_experts_grouped(x, top_i, top_p, w_in, w_down, act, impl="pallas", interpret=INTERPRET)
    finally:
        gm.default_tuning, layers.default_block_m = saved_tuning, saved_bm


def bench_engine(quick: bool, tiny: bool = False, quantizations=("none", "fp8"), impls=("dense", "grouped"),
                 rows: list | None = None, save=lambda: None, prefill: bool = True,
                 profile: str | None = None) -> list[dict]:
    import jhybrid
    from benchmarks.decode_step import random_model
    from benchmarks.fp8 import MOE_OVERRIDES, decode_steps, prefill_seconds
    from jhybrid.model_loader import quantize

    rows = [] if rows is None else rows
    for quantization in quantizations:
        gc.collect()
        model = quantize(random_model(tiny=tiny, overrides=MOE_OVERRIDES), quantization)
        for impl in impls:
            layers.MOE_IMPL = impl
            jax.clear_caches()  # the switch is read at trace time
            llm = jhybrid.LLM(model, dtype=None, quantization=quantization, max_num_seqs=64, max_model_len=1280,
                              num_kv_blocks=64 * 1280 // 16 + 64, max_num_batched_tokens=2048)
            row = dict(quantization=quantization, moe=impl)
            for b in (1,) if quick else (1, 64):
                step = decode_steps(llm, b)
                row[f"decode_step_ms_b{b}"] = step
                row[f"decode_tok_s_b{b}"] = b / step * 1e3
            if prefill:
                row["prefill_16x1024_s"] = prefill_seconds(llm)
                row["prefill_tok_s"] = 16 * 1024 / row["prefill_16x1024_s"]
            if profile:  # the batch-1 decode step's kernels on the device (JAX profiler)
                from benchmarks.sampling_cost import kernel_ms_per_decode_step

                sp = jhybrid.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
                vocab = llm.engine.model.cfg.vocab_size
                total, per = kernel_ms_per_decode_step(llm.engine, [[(5 * t + 3) % vocab for t in range(512)]], sp,
                                                       f"{profile}/{quantization}-{impl}")
                row["b1_kernel_ms"] = total
                row["b1_top_kernels_ms"] = dict(sorted(per.items(), key=lambda kv: -kv[1])[:12])
            log(json.dumps(row))
            rows.append(row)
            save()  # a run cut short keeps the rows it measured
            del llm
            gc.collect()
        del model
    layers.MOE_IMPL = "auto"
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write {machine, layer, engine} here")
    parser.add_argument("--tokens", default="1,8,64,256,2048,8192", help="token counts of the layer cases")
    parser.add_argument("--no-sweep", action="store_true", help="time the default tiles only")
    parser.add_argument("--sweep-budget-s", type=float, default=240, help="stop sweeping tiles after this long")
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="layer: the shapes to run, by name")
    parser.add_argument("--weights", default="bf16,fp8", help="layer: the weights' forms to run")
    parser.add_argument("--skip-layer", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--quick", action="store_true", help="engine: batch 1 only")
    parser.add_argument("--quantization", default="none,fp8", help="engine: the weights' forms to run")
    parser.add_argument("--impls", default="dense,grouped", help="engine: the MoE paths to run (MOE_IMPL)")
    parser.add_argument("--no-prefill", action="store_true", help="engine: skip the prefill timing")
    parser.add_argument("--profile", metavar="DIR", help="engine: profile batch-1 decode steps into DIR and report "
                        "their kernel time, by kernel")
    parser.add_argument("--tiny", action="store_true", help="toy shapes and model (a CPU smoke run)")
    args = parser.parse_args(argv)
    bandwidth = copy_bandwidth()
    out = dict(machine=machine_info(), copy_bandwidth_gbs=bandwidth / 1e9)
    log(f"machine {out['machine']}; copy bandwidth {bandwidth / 1e9:.0f} GB/s")

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)

    nan = float("nan")
    if not args.skip_layer:
        out["layer"] = bench_layer([int(t) for t in args.tokens.split(",")], bandwidth, not args.no_sweep,
                                   args.sweep_budget_s,
                                   TINY_SHAPES if args.tiny else [s for s in SHAPES if s[0] in args.shapes.split(",")],
                                   [w == "fp8" for w in args.weights.split(",")])
        save()
        log("\n| shape | weights | tokens | dense ms | grouped ms (default tiles) | best ms | its tiles | floor ms | "
            "grouped / floor | dense / grouped | rel err vs dense |")
        log("|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
        for r in out["layer"]:
            log(f"| {r['shape']} | {'fp8' if r['fp8'] else 'bf16'} | {r['tokens']} | {r.get('dense_ms', nan):.4f} | "
                f"{r['grouped_ms']:.4f} | {r.get('best_ms', nan):.4f} | {r.get('best_config', '-')} | "
                f"{r['floor_ms']:.4f} | {r['grouped_ms'] / r['floor_ms']:.2f} | "
                f"{r.get('dense_ms', nan) / r['grouped_ms']:.2f} | {r.get('rel_err', nan):.1e} |")
    if not args.skip_engine:
        out["engine"] = []
        bench_engine(args.quick, args.tiny, args.quantization.split(","), args.impls.split(","), out["engine"], save,
                     not args.no_prefill, args.profile)
        keys = [k for k in out["engine"][0] if k not in ("quantization", "moe", "b1_top_kernels_ms")]
        log("\n| weights | experts | " + " | ".join(keys) + " |\n|---|---|" + "---:|" * len(keys))
        for r in out["engine"]:
            log(f"| {r['quantization']} | {r['moe']} | " + " | ".join(f"{r[k]:.3f}" for k in keys) + " |")
    save()


if __name__ == "__main__":
    main()
