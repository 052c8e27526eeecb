"""Issue 20's table in one run: each model-level figure through the public `jhybrid.LLM` API beside the floor it is
measured against, then the kernel rows of `benchmarks.kernels --quick`, all on one GPU in one call.

    PYTHONPATH=. python3 -m benchmarks.floors [--json out.json] [--only qwen3_next,nemotron_h,minimax] [--skip-kernels]
        [--decode-only | --prefill-only] [--device-loop]
    PYTHONPATH=. python -m benchmarks.floors --tiny --skip-kernels      # CPU smoke test (tiny shapes, no floors)

Models (random bf16 weights made on the device, `benchmarks.decode_step.random_params`):
- `qwen3_next`: the 2.2 B Qwen3-Next-shaped dense hybrid of benchmarks/generate.py (vocab 151,936).
- `nemotron_h`: a NemotronH-shaped Mamba2 hybrid (hidden 2048, 64 Mamba2 heads of 64 in 8 groups, state 128,
  relu^2 MLPs of 8192, 4 attention layers of 16 q / 2 kv heads of 128, vocab 131,072), about 1.7 B.
- `minimax`: a MiniMax-M1-shaped lightning hybrid (hidden 2048, 16 heads of 128, 10 layers with the 8th full
  attention, every MLP 32 experts of 512 with top-2, vocab 200,064), about 2.1 B.
- `qwen3_next_80b_4l` (not in the default `--only`): four layers of the published Qwen3-Next-80B-A3B config (three
  Gated DeltaNet and one full attention; every MLP 512 experts of 512 with top-10 and a shared expert), about
  13.8 B: a batch-1 token's routed experts at the real model's shape (10 expert tiles a layer).

Per model, in a subprocess of its own (so each has the whole device):
- batch-1 decode: median decode-only engine step (512-token prompt, 64 new tokens, the second round), against
  its bytes floor: the parameter bytes a token reads (every weight but the embedding table, of which one row;
  of the routed experts only top-k of E) plus one sequence's linear state read and written (fp32) plus its KV
  read, over the read bandwidth measured in the same process (a jnp reduction over 4 GiB, the best of five rounds
  of ten calls queued back to back);
- batch-256 decode (qwen3_next; prompt 512, 128 new tokens): the same step, tokens/s, and its bytes floor
  (weights once, 256 sequences' KV at the mean context and their state read and written);
- prefill of one 8,192-token prompt (`max_tokens=1`, the median of 5 calls after the one that compiles): ms, and
  the model FLOPs' share of the bf16 matmul rate measured in the same process (XLA, 8192^3). Model FLOPs: 2 x
  the matmul weights a token passes (the LM head once per prompt, not per token) x tokens, plus causal attention
  (2 x T^2 x heads x head dim per full-attention layer); the linear layers' recurrences are not counted.

On the H200 (no network), with the serving wheels and fla's carried in the git-ignored `.whl/` (fla-core and
flash-linear-attention 0.6.0 are pure Python: `pip download --no-deps --only-binary=:all: --python-version 3.12
-d .whl fla-core==0.6.0 flash-linear-attention==0.6.0`), one device call:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
        PYTHONPATH=/tmp/site:. python3 -m benchmarks.floors --json $OUT/floors.json

Then `python3 -m benchmarks.kernels --quick` in one more subprocess (the paged decode and prefill attention, the
Gated DeltaNet decode and chunked prefill, each checked against its reference before it is timed, beside jax's
Pallas paged attention, cuDNN and fla where they are installed). The table prints each row's figure, its floor or
baseline, the ratio and issue 20's aim; `--json` writes {machine_info, models, kernels}.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

NEMOTRON_H = dict(
    model_type="nemotron_h", vocab_size=131072, hidden_size=2048, intermediate_size=8192, mlp_hidden_act="relu2",
    hybrid_override_pattern="M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-", num_attention_heads=16,
    num_key_value_heads=2, attention_head_dim=128, mamba_num_heads=64, mamba_head_dim=64, n_groups=8,
    ssm_state_size=128, conv_kernel=4, expand=2, chunk_size=128, layer_norm_epsilon=1e-5,
    max_position_embeddings=16384, tie_word_embeddings=False, use_conv_bias=True, mamba_proj_bias=False,
    use_bias=False, time_step_limit=[0.0, float("inf")], residual_in_fp32=False,
)
MINIMAX = dict(
    model_type="minimax_m1", vocab_size=200064, hidden_size=2048, intermediate_size=512, head_dim=128,
    num_attention_heads=16, num_key_value_heads=8, num_hidden_layers=10, attn_type_list=[0] * 7 + [1] + [0] * 2,
    num_local_experts=32, num_experts_per_tok=2, rotary_dim=64, rope_theta=10000000.0,
    layernorm_full_attention_alpha=3.55, layernorm_full_attention_beta=1.0, layernorm_linear_attention_alpha=3.55,
    layernorm_linear_attention_beta=1.0, layernorm_mlp_alpha=3.55, layernorm_mlp_beta=1.0, postnorm=True,
    rms_norm_eps=1e-5, max_position_embeddings=16384, tie_word_embeddings=False, shared_intermediate_size=0,
    hidden_act="silu",
)
# Qwen3-Next-80B-A3B as published (../shared/real_configs), cut to its first four layers
QWEN3_NEXT_80B_4L = dict(
    model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=4,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25, rope_theta=10000000,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, full_attention_interval=4, num_experts=512, num_experts_per_tok=10,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, decoder_sparse_step=1, norm_topk_prob=True,
    mlp_only_layers=[], rms_norm_eps=1e-6, max_position_embeddings=16384, tie_word_embeddings=False,
)
# the CPU smoke test's shapes: every family's structure, a few MB
TINY = {
    "qwen3_next": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=512),
    "nemotron_h": dict(hidden_size=64, intermediate_size=128, hybrid_override_pattern="M-M*-", num_attention_heads=4,
                       num_key_value_heads=2, attention_head_dim=16, mamba_num_heads=8, mamba_head_dim=16,
                       n_groups=2, ssm_state_size=16, chunk_size=16, vocab_size=512),
    "minimax": dict(hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                    num_hidden_layers=3, attn_type_list=[0, 1, 0], num_local_experts=4, rotary_dim=8,
                    vocab_size=512),
    "qwen3_next_80b_4l": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                              linear_value_head_dim=16, num_experts=16, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32, vocab_size=512),
}
# issue 20's aims, per row
AIMS = {"decode_b1": 1.25, "decode_b1_nemotron_h": 1.3, "decode_b1_minimax": 1.3, "decode_b256": 1.4,
        "prefill_8k": 0.70, "prefill_8k_nemotron_h": 0.55}


def log(*a):
    print(*a, flush=True)


def hf_config(name: str, tiny: bool) -> dict:
    from benchmarks.generate import HF_CONFIG

    base = {"qwen3_next": dict(HF_CONFIG, model_type="qwen3_next"), "nemotron_h": dict(NEMOTRON_H),
            "minimax": dict(MINIMAX), "qwen3_next_80b_4l": dict(QWEN3_NEXT_80B_4L)}[name]
    if tiny:
        base.update(TINY[name])
    base.update(dtype="bfloat16", max_position_embeddings=16384)
    return base


# ----------------------------------------------------------------------------------------- what a step must move
def byte_counts(cfg, shapes: dict[str, tuple], itemsize: int = 2) -> dict:
    """Parameter bytes split into what every token reads (`dense`: all but the embedding table, whose one row is
    negligible, and the routed experts) and the routed experts (`experts`, with `top_k` of `num_experts` read per
    token at batch 1); one sequence's linear-layer state bytes (fp32) and KV bytes per token (all full layers)."""
    experts, dense, matmul_per_token = 0, 0, 0
    num_experts = cfg.num_experts
    for name, shape in shapes.items():
        n = math.prod(shape) * itemsize
        if name == "embed":
            continue
        routed = (num_experts > 0 and ".mlp." in name and "router" not in name and "shared" not in name
                  and shape[0] == num_experts)
        if routed:
            experts += n
        else:
            dense += n
        if len(shape) >= 2 and name != "lm_head":
            matmul_per_token += math.prod(shape) * (cfg.num_experts_per_tok / num_experts if routed else 1)
    return dict(dense=dense, experts=experts, top_k=cfg.num_experts_per_tok, num_experts=num_experts,
                state=cfg.state_bytes_per_sequence(), kv_per_token=cfg.kv_bytes_per_token(itemsize),
                matmul_params_per_token=matmul_per_token)


def _best_seconds(f, *args, rounds: int = 5, calls: int = 10) -> float:
    """Seconds a call of the jitted `f(*args)`: the best of `rounds` rounds of `calls` calls queued back to back with
    one wait at the end, after one call that compiles it. Neither a call's launch nor the host's wait is timed, and
    the best round, because noise only ever slows a round down."""
    import jax

    f(*args).block_until_ready()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = [f(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def read_bandwidth(tiny: bool, rounds: int = 5, calls: int = 10) -> float:
    """Bytes/s of a jnp sum over 4 GiB of bf16 (reads only): the best of `rounds` rounds of `calls` calls queued
    back to back with one wait at the end, so that neither a call's launch nor the host's wait is timed, and the
    best round because noise only ever slows a round. (Until session 37 it was the median of single calls, each
    waited for: on one H200 that moved 2.74-3.93 TB/s between the model processes of one run, and a low reading
    made that model's floor lenient; benchmarks/RESULTS.md, "Session 37".)"""
    import jax
    import jax.numpy as jnp

    n = (1 << 20) if tiny else (2 << 30)  # elements
    a = jnp.ones((n,), jnp.bfloat16)
    return 2 * n / _best_seconds(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), a, rounds=rounds, calls=calls)


def matmul_tflops(tiny: bool, data: str = "ones") -> float:
    """bf16 matmul rate of XLA on n^3 (n = 8192), on matrices of ones (the rows' rate) or of normal draws
    (`data="random"`: a tensor core's clock under load depends on how many operand bits toggle, so the same GEMM
    can run faster on constant data; printed beside the rate, not used by the rows). Timed as `read_bandwidth` is
    (`_best_seconds`): until session 41 the median of single calls, each waited for, which read 562 TFLOP/s in one
    model's process and 691-740 in the others of one H100 run (benchmarks/RESULTS.md, "Session 41"), a low reading
    that made that model's prefill share lenient."""
    import jax
    import jax.numpy as jnp

    n = 512 if tiny else 8192
    if data == "ones":
        a = b = jnp.ones((n, n), jnp.bfloat16)
    else:
        a, b = jax.random.normal(jax.random.key(0), (2, n, n), jnp.bfloat16)
    return 2 * n**3 / _best_seconds(jax.jit(jnp.dot), a, b) / 1e12


# ----------------------------------------------------------------------------------------- one model (subprocess)
def worker(name: str, tiny: bool, out: str, prefill_only: bool = False, decode_only: bool = False,
           num_scheduler_steps: int | None = None) -> None:
    import jax

    from benchmarks.decode_step import random_params
    from jhybrid.config import ModelConfig
    from jhybrid.model_loader import LoadedModel
    from jhybrid.models.params import flatten_shapes, param_shapes

    row: dict = dict(model=name, device=jax.devices()[0].device_kind, num_scheduler_steps=num_scheduler_steps)

    def save():
        with open(out, "w") as f:
            json.dump(row, f, indent=1)

    cfg = ModelConfig.from_hf(hf_config(name, tiny))
    shapes = flatten_shapes(param_shapes(cfg))
    counts = byte_counts(cfg, shapes)
    row.update(params_b=sum(math.prod(s) for s in shapes.values()) / 1e9, **{f"bytes_{k}": v for k, v in counts.items()})
    bw = read_bandwidth(tiny)
    rate, random_rate = matmul_tflops(tiny), matmul_tflops(tiny, "random")
    row.update(read_tbps=bw / 1e12, matmul_tflops=rate, matmul_tflops_random=random_rate)
    log(f"[{name}] {row['params_b']:.3f} B params; read bandwidth {bw / 1e12:.2f} TB/s; bf16 matmul {rate:.0f} TFLOP/s "
        f"({random_rate:.0f} on random data)")
    model = LoadedModel(cfg=cfg, params=random_params(cfg), tokenizer=None)
    jax.block_until_ready(model.params)
    save()

    if not prefill_only:
        decode_rows(model, name, tiny, counts, bw, row, save, num_scheduler_steps)
    if not decode_only:
        prefill_row(model, cfg, tiny, counts, rate, row, save, name)


def decode_rows(model, name, tiny, counts, bw, row, save, num_scheduler_steps: int | None = None) -> None:
    import jhybrid
    from benchmarks.fp8 import decode_steps

    prompt, new = (32, 8) if tiny else (512, 64)
    batch_big = 4 if tiny else 256
    big = name == "qwen3_next"
    max_seqs = batch_big if big else 1
    llm = jhybrid.LLM(model, dtype=None, max_num_seqs=max_seqs, max_model_len=prompt + 2 * new + 8,
                      max_num_batched_tokens=64 if tiny else 2048, num_scheduler_steps=num_scheduler_steps)
    row["num_scheduler_steps"] = llm.engine.scheduler.num_scheduler_steps  # what ran (None asked: the default)
    step = decode_steps(llm, 1, prompt, new)
    floor = (counts["dense"] + counts["experts"] * (counts["top_k"] / counts["num_experts"] if counts["num_experts"] else 1)
             + 2 * counts["state"] + counts["kv_per_token"] * (prompt + new / 2)) / bw * 1e3
    row.update(decode_b1_ms=step, decode_b1_floor_ms=floor, decode_b1_ratio=step / floor)
    log(f"[{name}] batch-1 decode {step:.3f} ms; floor {floor:.3f} ms ({step / floor:.2f}x)")
    save()
    if big:
        steps = decode_steps(llm, batch_big, prompt, 2 * new)
        ctx = prompt + new  # the mean context over 2 * new decode steps
        floor = (counts["dense"] + counts["experts"] + batch_big * (2 * counts["state"] + counts["kv_per_token"] * ctx)) / bw * 1e3
        row.update(decode_b256_ms=steps, decode_b256_tok_s=batch_big / steps * 1e3, decode_b256_floor_ms=floor,
                   decode_b256_ratio=steps / floor, decode_b256_bytes=dict(
                       weights=counts["dense"] + counts["experts"], kv=batch_big * counts["kv_per_token"] * ctx,
                       state=batch_big * 2 * counts["state"]))
        log(f"[{name}] batch-{batch_big} decode {steps:.3f} ms ({batch_big / steps * 1e3:,.0f} tok/s); floor {floor:.3f} ms")
        save()
    del llm
    gc.collect()


def prefill_row(model, cfg, tiny, counts, rate, row, save, name) -> None:
    import jhybrid
    from benchmarks.fp8 import prefill_seconds

    length = 256 if tiny else 8192
    llm = jhybrid.LLM(model, dtype=None, max_num_seqs=1, max_model_len=length + 8, max_num_batched_tokens=length)
    seconds = prefill_seconds(llm, rows=1, length=length, repeats=5)
    attn = 2 * length**2 * cfg.num_heads * cfg.head_dim * cfg.num_full_layers
    flops = 2 * counts["matmul_params_per_token"] * length + attn
    row.update(prefill_8k_ms=seconds * 1e3, prefill_8k_tflops=flops / seconds / 1e12,
               prefill_8k_share=flops / seconds / 1e12 / rate, prefill_tokens=length)
    log(f"[{name}] prefill {length} tokens {seconds * 1e3:.1f} ms: {flops / seconds / 1e12:.0f} TFLOP/s, "
        f"{row['prefill_8k_share']:.0%} of the matmul rate")
    save()


# ----------------------------------------------------------------------------------------- the table
# issue 20's kernel rows: (op, the baseline its aim is against) -> (the aim, the row's field it is judged on, that
# field as the table shows it, met)
KERNEL_AIMS = {
    ("gdn_decode", "fla fused_recurrent"): ("faster", "speedup", lambda x: f"{x:.2f}x", lambda x: x > 1),
    ("paged_decode", "jax.experimental paged_attention"): (
        ">= 85% cp", "copy_share", lambda x: f"{x:.1%} cp", lambda x: x >= 0.85),
    ("gdn_chunk", "fla chunk (Triton)"): (">= 1.25x", "speedup", lambda x: f"{x:.2f}x", lambda x: x >= 1.25),
    ("prefill_split", "cuDNN attention, unpaged (XLA)"): (
        "<= 1.5x t", "speedup", lambda x: f"{1 / x:.2f}x t", lambda x: 1 / x <= 1.5),
}


def table(models: list[dict], kernels: list[dict]) -> list[str]:
    """Issue 20's rows beside their same-run floors or baselines, each with its aim and whether this run meets it.
    A kernel row's ratio is its time over the baseline's; where the aim is a speed-up, the figure column has it
    (x: baseline over jhybrid), where a share of the copy rate, that share (cp), where a time ratio, that (x t). A
    prefill's share of the matmul rate is of the rate on ones, then (in brackets) on random data; "random" in
    the last column: met against the random-data rate only."""
    lines = [f"{'row':<46} {'jhybrid':>12} {'floor / baseline':>18} {'ratio':>7} {'figure':>10} {'aim':>9} "
             f"{'met':>6}", "-" * 114]
    yes = lambda ok: "yes" if ok else "no"  # noqa: E731
    for m in models:
        n = m["model"]
        if "decode_b1_ms" in m:
            aim = AIMS.get(f"decode_b1_{n}", AIMS["decode_b1"])
            lines.append(f"{n + ' batch-1 decode ms':<46} {m['decode_b1_ms']:>12.3f} {m['decode_b1_floor_ms']:>18.3f} "
                         f"{m['decode_b1_ratio']:>6.2f}x {'':>10} {'<= ' + str(aim) + 'x':>9} "
                         f"{yes(m['decode_b1_ratio'] <= aim):>6}")
        if "decode_b256_ms" in m:
            aim = AIMS["decode_b256"]
            lines.append(f"{n + ' batch-256 decode ms (tok/s)':<46} "
                         f"{m['decode_b256_ms']:>6.3f} ({m['decode_b256_tok_s']:,.0f}) {m['decode_b256_floor_ms']:>11.3f} "
                         f"{m['decode_b256_ratio']:>6.2f}x {'':>10} {'<= ' + str(aim) + 'x':>9} "
                         f"{yes(m['decode_b256_ratio'] <= aim):>6}")
        if "prefill_8k_ms" in m:
            aim = AIMS.get(f"prefill_8k_{n}", AIMS["prefill_8k"] if n == "qwen3_next" else None)
            share, rand = m["prefill_8k_share"], None
            if m.get("matmul_tflops_random"):
                rand = m["prefill_8k_tflops"] / m["matmul_tflops_random"]
            figure = f"{share:.0%}" + (f" ({rand:.0%})" if rand is not None else "")
            met = "-" if not aim else "yes" if share >= aim else "random" if rand is not None and rand >= aim else "no"
            lines.append(f"{n + ' prefill ' + str(m['prefill_tokens']) + ' ms (% of matmul)':<46} "
                         f"{m['prefill_8k_ms']:>12.1f} {m['matmul_tflops']:>11.0f} TF/s {'':>7} {figure:>10} "
                         f"{'>= ' + format(aim, '.0%') if aim else '-':>9} {met:>6}")
    for k in kernels:
        ours = k.get("ours_ms") and k["ours_ms"][0]
        base = k.get("baseline_ms") and k["baseline_ms"][0]
        ratio = f"{ours / base:.2f}x" if ours and base else "-"
        aim, field, figure, met = KERNEL_AIMS.get((k["op"], k.get("baseline")), ("", None, None, None))
        # no verdict where the check failed (speedup None) or the row predates its field
        judged = field is not None and k.get("speedup") is not None and k.get(field) is not None
        status = "" if k.get("passed", True) else " FAIL"
        lines.append(f"{(k['op'] + ' ' + k['shape'])[:46]:<46} {ours or float('nan'):>12.3f} "
                     f"{(k.get('baseline') or '-')[:9]:>9} {base or float('nan'):>8.3f} {ratio:>7} "
                     f"{figure(k[field]) if judged else '':>10} {aim:>9} "
                     f"{(yes(met(k[field])) if judged else '-' if aim else ''):>6}{status}")
    return lines


def loop_table(loops: list[dict]) -> list[str]:
    """The batch-1 token of `benchmarks.device_loop` (no host between steps) per model: its floor, the loop, and
    the loop's kernels by kind, the matmuls beside the time of their weights at the read rate."""
    if not loops:
        return []
    kinds = ("matmul", "pallas", "cudnn", "xla", "copy")
    lines = ["", f"{'batch-1 token in one program (ms)':<36} {'floor':>7} {'loop':>7} {'weights':>8} "
             + " ".join(f"{k:>14}" for k in kinds), "-" * 139]
    for r in loops:
        by = r["loop_kernels"]["kinds"]
        weights = r["weight_bytes"] / (r["read_tbps"] * 1e12) * 1e3
        cells = " ".join(f"{by.get(k, {}).get('ms', 0.0):>7.3f} (x{by.get(k, {}).get('launches', 0.0):>3.0f})"
                         for k in kinds)
        lines.append(f"{r['model']:<36} {r['floor_ms']:>7.3f} {r['loop_ms']:>7.3f} {weights:>8.3f} {cells}")
    return lines


def run_part(label: str, cmd: list[str], out: str, timeout: float, failed: list[str]):
    """Runs one part of the table in a subprocess of its own: the JSON it wrote to `out` (also when it failed or ran
    out of time after writing some), or None; a failure or time-out is appended to `failed`."""
    log(f"== {label}")
    try:
        rc = subprocess.run(cmd, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if rc != 0:
        failed.append(f"{label}: {rc}")
    if not os.path.exists(out):
        return None
    with open(out) as f:
        return json.load(f)


# `benchmarks.kernels`' parts with a row in issue 20's table (not the prefix-hit suffix probe)
KERNEL_PARTS = "copy,decode,paged,chunk,probe,prefill"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write {machine_info, models, kernels} here")
    ap.add_argument("--only", default="qwen3_next,nemotron_h,minimax", help="models, comma-separated")
    ap.add_argument("--skip-kernels", action="store_true", help="no `benchmarks.kernels --quick` run")
    ap.add_argument("--prefill-only", action="store_true", help="only the models' prefill rows")
    ap.add_argument("--decode-only", action="store_true", help="only the models' decode rows")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke test of the script)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per subprocess")
    ap.add_argument("--num-scheduler-steps", type=int, default=None, help="the engines' multi-step decode (the "
                    "batch-1 rows' decode steps per program; batch 256 runs single steps whatever it is; default: "
                    "`jhybrid.LLM`'s, which runs these 64-token rows as single steps: its multi-step programs "
                    "compile only for rows with 512 tokens or more to go)")
    ap.add_argument("--device-loop", action="store_true", help="then `benchmarks.device_loop --trace` in one more "
                    "subprocess: each model's batch-1 token in one program of 32 steps, its kernels summed by kind "
                    "(matmul, pallas, cudnn, xla, copy) beside the weights' time at the read rate")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker, a.tiny, a.out, a.prefill_only, a.decode_only, a.num_scheduler_steps)
        return 0
    models, kernels, failed = [], [], []
    # each part's JSON lands beside --json as it is written, so a run cut short by a time limit keeps its rows
    keep = os.path.splitext(a.json)[0] + "-parts" if a.json else None
    if keep:
        os.makedirs(keep, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        tmp = keep or scratch
        for name in a.only.split(","):
            out = os.path.join(tmp, f"{name}.json")
            cmd = [sys.executable, "-m", "benchmarks.floors", "--worker", name, "--out", out]
            cmd += (["--tiny"] if a.tiny else []) + (["--prefill-only"] if a.prefill_only else [])
            cmd += ["--decode-only"] if a.decode_only else []
            if a.num_scheduler_steps is not None:
                cmd += ["--num-scheduler-steps", str(a.num_scheduler_steps)]
            row = run_part(name, cmd, out, a.timeout, failed)
            if row is not None:
                models.append(row)  # a worker cut short keeps the rows it measured
        if not a.skip_kernels:
            out = os.path.join(tmp, "kernels.json")
            cmd = [sys.executable, "-m", "benchmarks.kernels", "--quick", "--json", out, "--only", KERNEL_PARTS]
            kernels = (run_part("kernels", cmd, out, a.timeout, failed) or {}).get("results", [])
        loops = []
        if a.device_loop:
            out = os.path.join(tmp, "device_loop.json")
            cmd = [sys.executable, "-m", "benchmarks.device_loop", "--no-engine", "--steps", "32", "--models", a.only,
                   "--trace", os.path.join(scratch, "trace"), "--json", out] + (["--tiny"] if a.tiny else [])
            loops = [r for r in run_part("device loop", cmd, out, a.timeout, failed) or [] if "loop_kernels" in r]
    from benchmarks.provenance import git_commit

    info = dict(commit=git_commit(), device=models[0]["device"] if models else "?", tiny=a.tiny)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(machine_info=info, models=models, kernels=kernels, device_loop=loops, failed=failed), f,
                      indent=1)
    log(f"\nmachine: {info['device']} | commit {info['commit']}")
    for line in table(models, kernels) + loop_table(loops):
        log(line)
    for f in failed:
        log(f"FAILED {f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
