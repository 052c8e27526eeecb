"""The host memory tier on the GPU: recompute vs swap preemption vs offloaded attention end to end (CPU
attention over host-resident KV, or those blocks copied to the GPU every step).

    PYTHONPATH=. python -m benchmarks.offload [--json out.json] [--kv-gb 2] [--host-gb 48] [--num-requests 64]
                                              [--prompt-len 16384] [--max-tokens 128] [--max-num-seqs 64]
                                              [--modes recompute,swap,auto,offload-cpu,offload-cpu-sync,offload-copy]
    PYTHONPATH=. python -m benchmarks.offload --tiny     # CPU smoke test: a tiny model, short prompts

NumPy's OpenBLAS is made single-threaded (`jhybrid.engine.offload.single_threaded_blas`, as the engine does
with kv_offload="cpu"): the CPU attention workers call BLAS concurrently, and a multi-threaded OpenBLAS
serialises or oversubscribes them (on the H200 host, 8 workers were slower than 1 before this).

Model: the 2.2 B Qwen3-Next-shaped dense hybrid of benchmarks/generate.py (random bf16 weights; 6 full
layers, 16 q / 2 kv heads of dim 256: 12 KiB of KV per token). The GPU KV pool is capped at `--kv-gb`.
The scheduler admits only the prompts that fit and runs the rest later, so it preempts (recompute or
swap) only when running sequences outgrow the pool while decoding: give `--max-tokens` room to grow
(the H200 run of session 4, 4096 + 32 tokens, never preempted). Each run of a mode has a time budget
(`--mode-seconds`); what it has not finished by then is aborted and reported as not completed.

Measured in the same run, in this order:
1. host -> device and device -> host bandwidth (`jhybrid.engine.swap.measure_transfer_bandwidth`, the
   engine's pageable NumPy path), the same through page-locked ("pinned_host") memory, host memory read
   bandwidth (NumPy sum), and the engine's prefill rate is reported by the auto run's probe;
2. per full layer, for a decode batch whose older KV lives on the host: (a) CPU attention over it
   (`jhybrid.cache.host_attention.host_paged_attention`, returning (o, lse)) and (b) copying the same
   blocks to the GPU and attending there; both outputs are checked against each other first (a mismatch
   voids the row); times are per full layer (a decode step has `num_full_layers` of them, 6 here), so
   the CPU part hides only if it fits under the GPU work between two full layers;
3. end to end, `--modes`: `preemption_mode` = recompute, swap and auto (no offloading), and offloaded
   attention (`kv_offload`, preemption by recompute as the fallback): "offload-cpu" (CPU attention over the
   host blocks, two-sub-batch pipeline), "offload-cpu-sync" (the same, the GPU waiting at every full layer)
   and "offload-copy" (the host blocks copied to the GPU every step and attended there); these offload
   whenever a running sequence would otherwise be preempted (`offload_policy="always"`), and the "-admit"
   variants also to admit waiting ones (`offload_admission`, what session 4's H200 run measured);
   "offload-copy-cost" and "offload-cpu-cost" run the engine's default `offload_policy="cost"` (offload only
   where the cost model prices it below the preemption it avoids). Reported: wall
   time, generated tokens/s, requests completed, preemptions by mode, bytes swapped each way, and greedy-
   token agreement with the recompute run (bf16 batches of different composition may legitimately diverge
   late: `--tiny` is bf16 too, and offload-cpu's two half-size batches round differently there; in fp32
   every mode agrees, tests/test_offload_attention.py); "swap-pinned" and "auto-pinned" swap through
   page-locked host memory (`swap_transfer="pinned"`); then for the offload modes: blocks offloaded and bytes moved to the host,
   steps with host-KV rows vs plain steps, host tokens attended, CPU attention time (summed over worker
   threads), CPU job wall time and how much of it the step waited for (hidden = 1 - wait / job), and the
   copy mode's host -> device bytes.
A CPU path should be on by default only where these tables show it winning.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.decode_step import random_params
from benchmarks.generate import HF_CONFIG, log, machine_info

TINY_CONFIG = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0, full_attention_interval=4,
    max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
)


def host_read_bandwidth(nbytes: int) -> float:
    a = np.ones(nbytes // 4, np.float32)
    a.sum()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / float(np.median(times))


def pinned_transfer_bandwidth(nbytes: int) -> dict:
    """Transfers through page-locked host memory (JAX's "pinned_host" memory kind) next to the engine's
    pageable NumPy path, bytes/s each: device -> pinned, pinned -> device, a jitted gather whose output
    lands in pinned memory (how a swap out could go), and pinned -> NumPy (whether reading it on the CPU
    costs a copy). Empty where the backend has no pinned_host memory."""
    dev = jax.devices()[0]
    if "pinned_host" not in {m.kind for m in dev.addressable_memories()}:
        return {}
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    x = jnp.ones(nbytes // 2, jnp.bfloat16).block_until_ready()
    xp = jax.device_put(x, pinned).block_until_ready()
    rows = x.reshape(-1, 4096)
    half = jnp.arange(0, rows.shape[0], 2)
    gather = jax.jit(lambda a, i: a[i], out_shardings=pinned)
    rate = lambda fn, n=nbytes: n / timed(fn, 3)[0]  # noqa: E731
    return {
        "d2h_pinned": rate(lambda: jax.device_put(x, pinned).block_until_ready()),
        "h2d_pinned": rate(lambda: jax.device_put(xp, on_dev).block_until_ready()),
        "gather_to_pinned": rate(lambda: gather(rows, half).block_until_ready(), nbytes // 2),
        "pinned_to_numpy": rate(lambda: np.array(xp, copy=True)),
    }


def timed(fn, repeats: int) -> tuple[float, float, float]:
    fn()  # warm-up / compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return tuple(float(np.percentile(times, p)) for p in (50, 20, 80))


def attention_paths(cfg, rows: int, host_tokens: int, block_size: int, repeats: int, threads: int) -> dict:
    """One full layer's decode attention over `host_tokens` host-resident tokens per row: CPU vs copy + GPU."""
    from jhybrid.cache.host_attention import host_paged_attention
    from pallas_kernels.paged_attention import paged_attention

    import ml_dtypes

    kvh, hd, h = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    blocks_per_row = -(-host_tokens // block_size)
    rng = np.random.default_rng(0)
    shape = (rows * blocks_per_row + 1, block_size, kvh, hd)
    host_k = rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16)
    host_v = rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16)
    tables = (1 + np.arange(rows * blocks_per_row, dtype=np.int32)).reshape(rows, blocks_per_row)
    lengths = np.full(rows, host_tokens, np.int64)
    q = rng.standard_normal((rows, h, hd), np.float32)
    kv_bytes = 2 * rows * host_tokens * kvh * hd * 2

    o_cpu, _ = host_paged_attention(q, host_k, host_v, tables, lengths)
    cpu = timed(lambda: host_paged_attention(q, host_k, host_v, tables, lengths), repeats)
    from jhybrid.engine.offload import HostAttention

    class _Host:  # what HostAttention reads of a host tier
        k, v = (host_k,), (host_v,)

    pool = HostAttention(cfg, _Host(), "cpu", num_threads=threads)
    step = pool.register_step(tables)
    o_pool, _ = pool.attend(0, step, 0, q, lengths)
    err_pool = float(np.abs(o_pool - o_cpu).max())
    cpu_pool = timed(lambda: pool.attend(0, step, 0, q, lengths), repeats)

    positions = jnp.full((rows,), host_tokens - 1, jnp.int32)
    row_ids = jnp.arange(rows, dtype=jnp.int32)
    q_dev = jnp.asarray(q, jnp.bfloat16)

    def copy_and_attend():
        k_dev, v_dev = jax.device_put(host_k), jax.device_put(host_v)  # the blocks, copied this step
        o = paged_attention(q_dev, k_dev, v_dev, jnp.asarray(tables), row_ids, positions, decode=True)
        return o.block_until_ready()

    o_gpu = np.asarray(copy_and_attend(), np.float32)
    err = float(np.abs(o_gpu - o_cpu).max())
    copy = timed(copy_and_attend, repeats)
    return dict(rows=rows, host_tokens=host_tokens, kv_bytes=kv_bytes, max_abs_err=max(err, err_pool),
                ok=err < 3e-2 and err_pool < 1e-5, cpu_s=cpu[0], cpu_p20=cpu[1], cpu_p80=cpu[2],
                cpu_threads=threads, cpu_pool_s=cpu_pool[0], cpu_pool_p20=cpu_pool[1], cpu_pool_p80=cpu_pool[2],
                copy_s=copy[0], copy_p20=copy[1], copy_p80=copy[2],
                cpu_tokens_per_s=rows * host_tokens / cpu_pool[0], cpu_bytes_per_s=kv_bytes / cpu_pool[0])


# mode -> (kv_offload, offload_overlap, offload_admission, offload_policy); the plain modes force offloading
# ("always") to time the paths; "-cost" modes run the engine's default policy
OFFLOAD_MODES = {"offload-cpu": ("cpu", True, False, "always"), "offload-cpu-sync": ("cpu", False, False, "always"),
                 "offload-copy": ("copy", False, False, "always"), "offload-copy-admit": ("copy", False, True, "always"),
                 "offload-cpu-admit": ("cpu", True, True, "always"), "offload-copy-cost": ("copy", False, False, "cost"),
                 "offload-cpu-cost": ("cpu", True, False, "cost")}
OFFLOAD_STATS = ("num_offloaded_blocks", "num_offloads_declined", "offload_bytes", "num_steps_plain", "num_steps_host", "num_host_rows",
                 "host_tokens_attended", "num_cpu_calls", "cpu_attention_seconds", "cpu_job_seconds",
                 "cpu_wait_seconds", "copy_bytes", "copy_seconds", "host_blocks_total")


def swap_round_trip(cfg, tokens: int, block_size: int, transfer: str, repeats: int) -> dict:
    """One sequence of `tokens` tokens swapped out and back in through `jhybrid.engine.swap.Swapper` with
    `transfer` ("pageable": NumPy host tier; "pinned": the data stays in pinned_host memory), on a device
    state with random contents: host seconds out (dispatch + flush, waited), in (waited), and whether the
    restored pages and slot are bit-exact."""
    from jhybrid.cache.host_tier import HostTier, plan_host_tier
    from jhybrid.cache.state import CacheConfig, init_state
    from jhybrid.engine.scheduler import SwapOp
    from jhybrid.engine.swap import Swapper

    n = -(-tokens // block_size)
    cache = CacheConfig(num_blocks=2 * n + 1, block_size=block_size, num_slots=3, kv_dtype="bfloat16")
    state = init_state(cfg, cache)
    key = jax.random.key(0)
    state = jax.tree.map(lambda x: jax.random.normal(key, x.shape, jnp.float32).astype(x.dtype), state)
    tier = plan_host_tier(cfg, cache, host_kv_memory_gb=1.05 * (n * block_size * cfg.kv_bytes_per_token(2)
                                                                 + cfg.state_bytes_per_sequence()) / 2**30 + 0.01,
                          max_num_seqs=1)
    host = HostTier(cfg, tier)
    swapper = Swapper(host, transfer)
    src, dst = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1))
    outs, ins, exact = [], [], True
    for i in range(repeats + 1):  # the first compiles
        entry = host.reserve(tokens)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        swapper.swap_out(state, [SwapOp("probe", src, 1, entry)])
        swapper.flush()
        jax.block_until_ready(list(swapper._resident.values()))
        t1 = time.perf_counter()
        state = swapper.swap_in(state, [SwapOp("probe", dst, 2, entry)])
        jax.block_until_ready(state)
        t2 = time.perf_counter()
        if i:
            outs.append(t1 - t0)
            ins.append(t2 - t1)
        ids_src, ids_dst = jnp.asarray(src), jnp.asarray(dst)
        exact &= all(bool(jnp.array_equal(p[ids_src], p[ids_dst])) for p in state.k_pages + state.v_pages)
        exact &= all(bool(jnp.array_equal(c[1], c[2])) for c in state.conv + state.ssm)
    nbytes = host.entry_bytes(n)
    out_s, in_s = float(np.median(outs)), float(np.median(ins))
    return dict(tokens=tokens, transfer=transfer, bytes=nbytes, out_s=out_s, in_s=in_s, exact=exact,
                out_gb_per_s=nbytes / out_s / 1e9, in_gb_per_s=nbytes / in_s / 1e9)


def _generate_within(llm, prompts, params, seconds: float, tag: str):
    """Runs every prompt through the engine until all finish or `seconds` pass; the unfinished ones are
    then aborted (a slow mode reports how many it completed, not a timeout). Returns ([(token ids,
    finish reason)], wall seconds, whether the budget cut the run)."""
    eng = llm.engine
    t0 = time.perf_counter()
    seqs = [eng.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    while eng.has_unfinished() and time.perf_counter() - t0 < seconds:
        eng.step()
    wall = time.perf_counter() - t0
    cut = eng.has_unfinished()
    for seq in seqs:
        eng.abort(seq.request_id)  # no-op for finished ones
    while eng.has_unfinished():  # steps still in flight after the aborts
        eng.step()
    outs = [(list(seq.output_ids), seq.finish_reason) for seq in seqs]
    for seq in seqs:
        eng.release(seq.request_id)
    return outs, wall, cut


def end_to_end(model, mode: str, args, kv_blocks: int) -> dict:
    import jhybrid

    rng = np.random.default_rng(1)
    vocab = model.cfg.vocab_size
    prompts = [rng.integers(0, vocab, size=args.prompt_len).tolist() for _ in range(args.num_requests)]
    offload = OFFLOAD_MODES.get(mode)
    kw = dict(preemption_mode=mode.removesuffix("-pinned"), swap_transfer="pinned" if mode.endswith("-pinned") else "pageable")
    if offload is not None:
        kw = dict(preemption_mode="recompute", kv_offload=offload[0], offload_overlap=offload[1],
                  offload_admission=offload[2], offload_policy=offload[3], offload_threads=args.cpu_threads)
    llm = jhybrid.LLM(model, dtype=None, max_num_seqs=args.max_num_seqs, max_model_len=args.prompt_len + args.max_tokens,
                      num_kv_blocks=kv_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
                      host_kv_memory_gb=0.0 if mode == "recompute" else args.host_gb, **kw)
    params = jhybrid.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.repeats):  # one engine: earlier runs compile its shapes; the last is reported
        before = llm.engine.stats()
        budget = args.mode_seconds if i == args.repeats - 1 else (args.warmup_seconds or args.mode_seconds)
        outs, wall, cut = _generate_within(llm, prompts, params, budget, f"{mode}-{i}")
    after = llm.engine.stats()
    st = {k: v if k.endswith("_total") else v - before[k] for k, v in after.items()}  # the reported run only
    cost = llm.engine.cost_model
    done = sum(reason == "length" and len(toks) == args.max_tokens for toks, reason in outs)
    result = dict(mode=mode, wall_s=wall, completed=done, requests=len(prompts), cut_at_budget=cut,
                  gen_tokens_per_s=sum(len(toks) for toks, _ in outs) / wall, tokens=[toks for toks, _ in outs],
                  **{k: st[k] for k in ("num_recompute_preemptions", "num_swap_preemptions", "num_swap_fallbacks",
                                        "swap_out_bytes", "swap_in_bytes", "swap_out_seconds", "swap_in_seconds",
                                        "host_bytes_total", *OFFLOAD_STATS)})
    log(f"  {mode}: {wall:.2f} s, {result['gen_tokens_per_s']:.1f} tok/s, {done}/{len(prompts)} done"
        + (f" (cut at the {args.mode_seconds:g} s budget)" if cut else ""))
    if cost is not None:
        result.update(probe_h2d_gbps=cost.h2d_bytes_per_s / 1e9, probe_d2h_gbps=cost.d2h_bytes_per_s / 1e9,
                      probe_prefill_tokens_per_s=cost.prefill_tokens_per_s)
    del llm
    gc.collect()
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model and sizes")
    parser.add_argument("--kv-gb", type=float, default=2.0, help="GPU KV pool cap")
    parser.add_argument("--host-gb", type=float, default=48.0, help="host tier size")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16384)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--attn-rows", default="8,32", help="decode rows with host KV (part 2)")
    parser.add_argument("--attn-host-tokens", default="4096,16384", help="host tokens per row (part 2)")
    parser.add_argument("--modes", default="recompute,swap,auto,offload-cpu,offload-cpu-sync,offload-copy")
    parser.add_argument("--parts", default="attention,swap,e2e",
                        help="what to run after the bandwidth probes: attention (CPU vs copy per layer), swap "
                        "(one sequence's swap round trip, pageable vs pinned), e2e (the --modes runs)")
    parser.add_argument("--swap-tokens", default="2048,16384", help="sequence lengths of the swap round trip")
    parser.add_argument("--cpu-threads", type=int, default=None, help="CPU attention workers (default: cores / 2, <= 8)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode (one engine); the last is reported")
    parser.add_argument("--mode-seconds", type=float, default=120.0,
                        help="time budget of each run of a mode: requests unfinished by then are aborted and the "
                             "mode reports how many completed (throughput counts the tokens it made)")
    parser.add_argument("--warmup-seconds", type=float, default=None,
                        help="time budget of the runs before the reported one (they compile the engine's shapes; "
                             "default: --mode-seconds)")
    args = parser.parse_args(argv)
    from jhybrid.config import ModelConfig
    from jhybrid.model_loader import LoadedModel
    from jhybrid.engine.swap import measure_transfer_bandwidth

    if args.tiny:
        args.kv_gb, args.host_gb, args.num_requests, args.prompt_len = 6e-5, 0.01, 12, 100
        args.max_tokens, args.max_num_seqs, args.max_num_batched_tokens = 48, 6, 512
        args.attn_rows, args.attn_host_tokens, args.swap_tokens = "2,4", "64,256", "64,256"
    hf = dict(TINY_CONFIG if args.tiny else HF_CONFIG, model_type="qwen3_next", dtype="bfloat16")
    hf["max_position_embeddings"] = max(hf["max_position_embeddings"], args.prompt_len + args.max_tokens)
    cfg = ModelConfig.from_hf(hf)
    block_size = 16
    info = machine_info()
    log(f"# {info['device']} | jax {info['jax']} | commit {info['commit']}")

    # 1. bandwidths
    probe = (16 << 20) if args.tiny else (512 << 20)
    h2d, d2h = measure_transfer_bandwidth(probe)
    host_bw = host_read_bandwidth((64 << 20) if args.tiny else (2 << 30))
    log(f"host->device {h2d / 1e9:.2f} GB/s | device->host {d2h / 1e9:.2f} GB/s | host memory read {host_bw / 1e9:.2f} GB/s")
    pinned = pinned_transfer_bandwidth(probe)
    info["pinned_bytes_per_s"] = pinned
    if pinned:
        log("pinned host memory: " + " | ".join(f"{k.replace('_', ' ')} {v / 1e9:.2f} GB/s" for k, v in pinned.items()))

    parts = set(args.parts.split(","))
    if parts - {"attention", "swap", "e2e"}:
        parser.error(f"unknown --parts {sorted(parts - {'attention', 'swap', 'e2e'})}")
    # 2. attention over host-resident KV: CPU vs copy to the GPU (per full layer)
    attn = []
    import os

    from jhybrid.engine.offload import single_threaded_blas

    threads = args.cpu_threads or max(1, min(8, (os.cpu_count() or 2) // 2))  # the engine's default
    if "attention" in parts:
        log(f"\nCPU attention per full layer ({threads} workers as in the engine; NumPy BLAS: {single_threaded_blas()})")
        log(f"\n{'rows':>5} {'host tok':>9} {'KV MB':>8} {'CPU ms':>9} {f'CPU x{threads} ms':>11} {'copy+GPU ms':>12} "
            f"{'CPU GB/s':>9} {'wins':>6}")
    for rows in (int(x) for x in args.attn_rows.split(",")) if "attention" in parts else ():
        for n in (int(x) for x in args.attn_host_tokens.split(",")):
            r = attention_paths(cfg, rows, n, block_size, repeats=3 if args.tiny else 5, threads=threads)
            r["wins"] = ("cpu" if r["cpu_pool_s"] < r["copy_s"] else "copy") if r["ok"] else "INVALID"
            attn.append(r)
            log(f"{rows:5d} {n:9d} {r['kv_bytes'] / 1e6:8.1f} {r['cpu_s'] * 1e3:9.2f} {r['cpu_pool_s'] * 1e3:11.2f} "
                f"{r['copy_s'] * 1e3:12.2f} "
                f"{r['cpu_bytes_per_s'] / 1e9:9.2f} {r['wins']:>6}" + ("" if r["ok"] else f"  (max err {r['max_abs_err']:.2e})"))

    # 3. one sequence's swap round trip: pageable (NumPy host tier) vs pinned (stays in pinned_host memory)
    swaps = []
    transfers = ["pageable"] + (["pinned"] if pinned else [])
    if "swap" in parts:
        log(f"\n{'tokens':>7} {'transfer':>9} {'MB':>8} {'out ms':>8} {'in ms':>8} {'out GB/s':>9} {'in GB/s':>8} "
            "exact")
        for tokens in (int(x) for x in args.swap_tokens.split(",")):
            for transfer in transfers:
                r = swap_round_trip(cfg, tokens, block_size, transfer, repeats=2 if args.tiny else 3)
                swaps.append(r)
                log(f"{tokens:7d} {transfer:>9} {r['bytes'] / 1e6:8.1f} {r['out_s'] * 1e3:8.2f} {r['in_s'] * 1e3:8.2f} "
                    f"{r['out_gb_per_s']:9.2f} {r['in_gb_per_s']:8.2f} {r['exact']}")
        if args.tiny:
            assert all(r["exact"] for r in swaps), swaps
    if "e2e" not in parts:
        return _write_json(args, info, h2d, d2h, host_bw, attn, [], swaps)

    # 4. end to end: recompute vs swap vs auto vs offloaded attention under a capped GPU KV pool
    model = LoadedModel(cfg=cfg, params=random_params(cfg))
    block_bytes = block_size * cfg.kv_bytes_per_token(2)
    kv_blocks = max(int(args.kv_gb * 2**30 // block_bytes), -(-(args.prompt_len + args.max_tokens) // block_size) + 1)
    log(f"\nGPU KV pool: {kv_blocks} blocks of {block_size} ({kv_blocks * block_bytes / 2**30:.2f} GiB); "
        f"{args.num_requests} requests x {args.prompt_len} prompt + {args.max_tokens} new tokens")
    # each mode runs `--repeats` times on one engine and the last run is reported: earlier ones compile
    runs = []
    for mode in args.modes.split(","):
        runs.append(end_to_end(model, mode, args, kv_blocks))
        _write_json(args, info, h2d, d2h, host_bw, attn, runs, swaps)  # partial results survive a timeout
    base = next((r for r in runs if r["mode"] == "recompute"), runs[0])
    log(f"{'mode':>17} {'wall s':>8} {'tok/s':>9} {'done':>7} {'recomp':>7} {'swaps':>6} {'fallbk':>6} "
        f"{'out MB':>9} {'in MB':>9} {'agree':>6}")
    for r in runs:
        agree = np.mean([a == b for a, b in zip(r["tokens"], base["tokens"])])
        r["agreement"] = float(agree)
        log(f"{r['mode']:>17} {r['wall_s']:8.2f} {r['gen_tokens_per_s']:9.1f} {r['completed']:3d}/{r['requests']:<3d} "
            f"{r['num_recompute_preemptions']:7d} {r['num_swap_preemptions']:6d} {r['num_swap_fallbacks']:6d} "
            f"{r['swap_out_bytes'] / 1e6:9.1f} {r['swap_in_bytes'] / 1e6:9.1f} {agree:6.2f}")
        if "probe_prefill_tokens_per_s" in r:
            log(f"{'':>17} cost model's probe: H2D {r['probe_h2d_gbps']:.2f} GB/s, D2H {r['probe_d2h_gbps']:.2f} GB/s, "
                f"prefill {r['probe_prefill_tokens_per_s']:.0f} tokens/s")
    offloaded = [r for r in runs if r["mode"] in OFFLOAD_MODES]
    if offloaded:
        log(f"\n{'mode':>17} {'offl blk':>9} {'declined':>8} {'offl MB':>8} {'host st':>8} {'plain st':>8} {'host rows':>9} "
            f"{'Mtok att':>9} {'CPU s':>7} {'job s':>7} {'wait s':>7} {'wait ms/st':>10} {'hidden':>7} {'copy MB':>9} "
            f"{'copy s':>7}")
        for r in offloaded:
            job = r["cpu_job_seconds"]
            r["cpu_hidden_fraction"] = hidden = 1.0 - r["cpu_wait_seconds"] / job if job > 0 else float("nan")
            r["cpu_wait_ms_per_host_step"] = wait_ms = 1e3 * r["cpu_wait_seconds"] / max(r["num_steps_host"], 1)
            log(f"{r['mode']:>17} {r['num_offloaded_blocks']:9d} {r['num_offloads_declined']:8d} "
                f"{r['offload_bytes'] / 1e6:8.1f} "
                f"{r['num_steps_host']:8d} {r['num_steps_plain']:8d} {r['num_host_rows']:9d} "
                f"{r['host_tokens_attended'] / 1e6:9.2f} {r['cpu_attention_seconds']:7.2f} {job:7.2f} "
                f"{r['cpu_wait_seconds']:7.2f} {wait_ms:10.2f} {hidden:7.2f} {r['copy_bytes'] / 1e6:9.1f} "
                f"{r['copy_seconds']:7.2f}")
    incomplete = [r["mode"] for r in runs if r["completed"] != r["requests"]]
    if incomplete:
        log(f"INCOMPLETE runs (no throughput claim): {incomplete}")
    if args.tiny:  # the smoke test fails loudly on a lost request
        assert not incomplete, incomplete
    return _write_json(args, info, h2d, d2h, host_bw, attn, runs, swaps)


def _write_json(args, info, h2d, d2h, host_bw, attn, runs, swaps) -> dict:
    results = dict(args=vars(args), h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, host_read_bytes_per_s=host_bw,
                   attention=attn, swap_round_trip=list(swaps),
                   end_to_end=[{k: v for k, v in r.items() if k != "tokens"} for r in runs])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine_info": info, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
