"""FP8 weights on the GPU (issue 22): the block-wise FP8 matmul kernel at the 2.2 B model's projection shapes,
then the engine end to end, bf16 against `quantization="fp8"`, in one run.

    PYTHONPATH=. python -m benchmarks.fp8 [--json out.json] [--quick]

1. Kernel: for each projection shape (K, N) of the 2.2 B Qwen3-Next-shaped model (benchmarks/generate.py) and
   M activation rows (decode batches and prefill chunks), the Pallas kernel (`pallas_kernels/fp8_matmul`) is
   checked against its jnp reference on the GPU, then timed for each tile in `CONFIGS` against the bf16 matmul
   (XLA: cuBLAS) and the XLA reference (dequantize then an fp32 dot); `floor` is the FP8 weight bytes over the
   copy bandwidth measured here. Each timed call runs `LAYERS` different weights (as the model's layers do),
   so weights stream from memory and the host's dispatch is amortized; ms are per matmul.
2. Engine: the same model (random bf16 weights) in `jhybrid.LLM` as bf16 and as fp8: parameter bytes and the
   device's bytes in use after loading, the steady-state decode step at batch 1 and 64 (512-token prompts,
   greedy), and a 16 x 1024-token prefill.
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
from pallas_kernels.fp8_matmul import (
    block_config,
    fp8_matmul_dequantized,
    fp8_matmul_pallas,
    fp8_matmul_reference,
    quantize_weight,
)

LAYERS = 8
# (block_m or None: the kernel's default, block_n, split_k (None: auto), prequantized, num_warps, num_stages)
CONFIGS = {
    "small": [(None, 64, None, True, 4, 3), (None, 128, None, True, 4, 3), (None, 64, 1, True, 4, 3),
              (None, 64, None, False, 4, 3)],
    "large": [(64, 128, 1, True, 4, 3), (128, 128, 1, True, 8, 3)],
}
SHAPES = ("attn.qkv_proj", "mlp.down_proj")  # a wide and a narrow output, K 2048 and 5632


def model_shapes(cfg) -> list[tuple[str, int, int]]:
    """(projection, K, N) of each FP8 projection of a Qwen3-Next-shaped dense config, packed as the model runs them."""
    d, i = cfg.hidden_size, cfg.intermediate_size
    q_out = cfg.num_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
    kv = cfg.num_kv_heads * cfg.head_dim
    hk, hv, k, v = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                    cfg.linear_value_head_dim)
    return [("attn.qkv_proj", d, q_out + 2 * kv), ("attn.o_proj", cfg.num_heads * cfg.head_dim, d),
            ("gdn.in_proj", d, 2 * hk * k + 2 * hv * v + 2 * hv), ("gdn.out_proj", hv * v, d),
            ("mlp.gate_up_proj", d, 2 * i), ("mlp.down_proj", i, d)]


def bench_kernel(cfg, ms: list[int], bandwidth: float, quick: bool) -> list[dict]:
    rows = []
    key = jax.random.key(0)
    for name, k, n in [s for s in model_shapes(cfg) if s[0] in SHAPES]:
        ws = [jax.random.normal(jax.random.fold_in(key, j), (k, n), jnp.float32) * 0.02 for j in range(LAYERS)]
        quant = [quantize_weight(w) for w in ws]
        ws = [w.astype(jnp.bfloat16) for w in ws]
        jax.block_until_ready((ws, quant))
        floor_ms = quant[0][0].nbytes / bandwidth * 1e3
        for m in ms:
            x = (jax.random.normal(jax.random.fold_in(key, 1000 + m), (m, k), jnp.float32)).astype(jnp.bfloat16)
            want = jax.jit(functools.partial(fp8_matmul_reference, n=n))(x, *quant[0])
            bf16 = jax.jit(lambda x, ws: [x @ w for w in ws])
            ref = jax.jit(lambda x, qs: [fp8_matmul_reference(x, q, s, n) for q, s in qs])
            t_bf16 = time_jax(bf16, (x, ws), reps=10)[0] / LAYERS
            t_ref = time_jax(ref, (x, quant), reps=5)[0] / LAYERS
            deq = jax.jit(lambda x, qs: [fp8_matmul_dequantized(x, q, s, n) for q, s in qs])
            t_deq = time_jax(deq, (x, quant), reps=10)[0] / LAYERS
            default = block_config(m)
            default = (default.get("block_m"), default["block_n"], default["split_k"], default["prequantized"],
                       default["num_warps"], default["num_stages"])
            best, t_default = None, None
            for bm, bn, sk, pq, nw, ns in CONFIGS["small" if m <= 64 else "large"][: 2 if quick else None]:
                kw = dict(n=n, block_m=bm, block_n=bn, split_k=sk, prequantized=pq, num_warps=nw, num_stages=ns)
                try:
                    got = fp8_matmul_pallas(x, *quant[0], **kw)
                    err, rel = errors(np.asarray(got, np.float32), np.asarray(want, np.float32))
                    f = jax.jit(lambda x, qs, kw=kw: [fp8_matmul_pallas(x, q, s, **kw) for q, s in qs])
                    t = time_jax(f, (x, quant), reps=10)[0] / LAYERS
                except Exception as e:  # a tile that does not compile (shared memory, registers) is reported
                    log(f"  {name} M{m} {kw}: FAILED {type(e).__name__}: {str(e)[:200]}")
                    continue
                ok = rel <= 1e-3
                log(f"  {name} K{k} N{n} M{m} {(bm, bn, sk, pq, nw, ns)}: {t:.4f} ms rel {rel:.1e} "
                    f"{'ok' if ok else 'WRONG'}")
                if ok and (best is None or t < best[0]):
                    best = (t, (bm, bn, sk, pq, nw, ns), rel)
                if (bm, bn, sk, pq, nw, ns) == default:
                    t_default = t if ok else None
            row = dict(proj=name, K=k, N=n, M=m, bf16_ms=t_bf16, reference_ms=t_ref, w8a16_ms=t_deq,
                       floor_ms=floor_ms, fp8_ms=best and best[0], config=best and best[1], rel_err=best and best[2],
                       default_ms=t_default)
            rows.append(row)
            log(f"{name:>16} K{k:>5} N{n:>6} M{m:>5}: bf16 {t_bf16:.4f}  fp8 {row['fp8_ms'] or float('nan'):.4f} "
                f"({row['config']}; default {t_default})  w8a16 {t_deq:.4f}  reference {t_ref:.4f}  "
                f"fp8 floor {floor_ms:.4f} ms")
        del ws, quant
        gc.collect()
    return rows


def decode_steps(llm, batch: int, prompt_len: int = 512, new: int = 64) -> float:
    """Median ms of the engine's decode-only steps for `batch` sequences (the second round: the first compiles)."""
    import jhybrid
    from benchmarks.decode_step import decode_step_times

    sp = jhybrid.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    vocab = llm.engine.model.cfg.vocab_size
    prompts = [[(7 * r + t) % vocab for t in range(1, prompt_len + 1)] for r in range(batch)]
    for rep in range(2):
        times = decode_step_times(llm.engine, prompts, sp, f"b{batch}-{rep}")
        llm.engine.runner.wait_burst_compiles()  # the offline default's multi-step programs: compiled by round 2
    return float(np.median(times[min(4, len(times) // 2):])) * 1e3  # (multi-step decode: fewer, longer steps)


def prefill_seconds(llm, rows: int = 16, length: int = 1024, repeats: int = 1) -> float:
    """Seconds of one `generate` of `rows` prompts of `length` tokens, `max_tokens=1`, after a call that compiles:
    the median of `repeats` calls (each with prompts of its own). The first call after the compiling one ran
    17 ms (25%) slower than the next ones for an 8k prompt on the H200 (benchmarks/RESULTS.md, session 27). Each
    call's prompts are built before its clock starts (through session 43 an 8k prompt's list was built inside it:
    ~1 ms on the CI machine)."""
    import jhybrid

    sp = jhybrid.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = llm.engine.model.cfg.vocab_size
    prompts = [[(11 * r + t) % vocab for t in range(length)] for r in range(rows)]
    llm.generate(prompts, sp, use_tqdm=False)  # compiles
    times = []
    for i in range(repeats):
        call = [[(t + 1 + i) % vocab for t in p] for p in prompts]
        t0 = time.perf_counter()
        llm.generate(call, sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# `--moe`: the same model with every MLP a Qwen3-Next MoE (64 routed experts of 512, 8 per token, a shared expert of
# 512), whose routed experts are most of its bytes and FP8 holds them (issue 22)
MOE_OVERRIDES = dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512,
                     shared_expert_intermediate_size=512, decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[])


def bench_engine(quick: bool, tiny: bool = False, moe: bool = False) -> list[dict]:
    import jhybrid
    from benchmarks.decode_step import random_model
    from jhybrid.model_loader import quantize

    rows = []
    for quantization in ("none", "fp8"):
        gc.collect()
        model = quantize(random_model(tiny=tiny, overrides=MOE_OVERRIDES if moe else None), quantization)
        jax.block_until_ready(model.params)
        param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
        in_use = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use", 0)
        llm = jhybrid.LLM(model, dtype=None, quantization=quantization, max_num_seqs=64, max_model_len=1280,
                          num_kv_blocks=64 * 1280 // 16 + 64, max_num_batched_tokens=2048)
        del model
        row = dict(quantization=quantization, param_gb=param_bytes / 1e9, device_in_use_after_load_gb=in_use / 1e9)
        for b in (1,) if quick else (1, 64):
            step = decode_steps(llm, b)
            row[f"decode_step_ms_b{b}"] = step
            row[f"decode_tok_s_b{b}"] = b / step * 1e3
        if not moe:  # the MoE's prefill is benchmarks/moe.py's (grouped against all-experts)
            row["prefill_16x1024_s"] = prefill_seconds(llm)
            row["prefill_tok_s"] = 16 * 1024 / row["prefill_16x1024_s"]
        log(json.dumps(row))
        rows.append(row)
        del llm
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write {machine, kernel, engine} here")
    parser.add_argument("--quick", action="store_true", help="two tiles, fewer M, batch 1 only (a smoke run)")
    parser.add_argument("--skip-kernel", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--m", default="1,64,2048", help="activation rows of the kernel cases")
    parser.add_argument("--kernel-first", action="store_true", help="time the kernels before the engine")
    parser.add_argument("--tiny", action="store_true", help="the engine part on a toy model (a CPU smoke run)")
    parser.add_argument("--moe", action="store_true", help="the engine part on the MoE form of the model "
                        "(MOE_OVERRIDES: FP8 routed experts), decode only")
    args = parser.parse_args(argv)
    from benchmarks.generate import HF_CONFIG
    from jhybrid.config import ModelConfig

    cfg = ModelConfig.from_hf(dict(HF_CONFIG, model_type="qwen3_next", dtype="bfloat16"))
    bandwidth = copy_bandwidth()
    log(f"machine {machine_info()}; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    out = dict(machine=machine_info(), copy_bandwidth_gbs=bandwidth / 1e9)

    def save():  # after each part: a run cut short keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    if args.kernel_first and not args.skip_kernel:
        out["kernel"] = bench_kernel(cfg, [int(m) for m in args.m.split(",")], bandwidth, args.quick)
        save()
    if not args.skip_engine:
        out["engine"] = bench_engine(args.quick, args.tiny, args.moe)
        base, fp8 = out["engine"][0], out["engine"][-1]
        log("\n| | bf16 | fp8 | fp8 / bf16 |\n|---|---:|---:|---:|")
        for k in base:
            if k != "quantization":
                log(f"| {k} | {base[k]:.3f} | {fp8[k]:.3f} | {fp8[k] / base[k] if base[k] else float('nan'):.2f} |")
        save()
    if not args.skip_kernel and not args.kernel_first:
        out["kernel"] = bench_kernel(cfg, [int(m) for m in args.m.split(",")], bandwidth, args.quick)
    if out.get("kernel"):
        nan = float("nan")
        log("\n| projection | K | N | M | bf16 ms | W8A8 kernel ms (best) | its config | default config ms | "
            "W8A16 (XLA dequant + bf16) ms | jnp reference ms | FP8 weight floor ms |")
        log("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
        for r in out["kernel"]:
            log(f"| {r['proj']} | {r['K']} | {r['N']} | {r['M']} | {r['bf16_ms']:.4f} | {r['fp8_ms'] or nan:.4f} "
                f"| {r['config']} | {r['default_ms'] or nan:.4f} | {r['w8a16_ms']:.4f} | {r['reference_ms']:.4f} "
                f"| {r['floor_ms']:.4f} |")
    save()


if __name__ == "__main__":
    main()
