"""End-to-end generation benchmark: jhybrid vs HF transformers `generate` on the same random bf16 weights.

    PYTHONPATH=. python -m benchmarks.generate [--json out.json] [--batches 1,32,128,256] [--hf-batches 1,32]

The model is a 2.2 B Qwen3-Next-shaped dense hybrid (hidden 2048, 24 layers with every 4th full attention,
16 q / 2 kv heads of dim 256, Gated DeltaNet with 16 key / 32 value heads of dim 128, intermediate 5632,
vocab 151936). HF builds it with random weights on the GPU and saves it; jhybrid loads those files through
its converter, so both run the same weights. Prompt 512 tokens, 128 new tokens, greedy, EOS ignored.

Reported: the copy bandwidth (measured here) and the batch-1 decode floor (weight bytes / that bandwidth),
jhybrid's batch-1 decode step time, and tokens/s (new tokens over wall time, prefill included) at each
batch for jhybrid and HF. Prints a machine line and a table; `--json` writes {machine_info, results}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

PROMPT, NEW = 512, 128
HF_CONFIG = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=0, full_attention_interval=4,
    max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
)


def log(*a):
    print(*a, flush=True)


def machine_info() -> dict:
    from benchmarks.provenance import git_commit

    return {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "commit": git_commit()}


def copy_bandwidth(gib: float = 4.0) -> float:
    """Device copy bandwidth in bytes/s counting read + write (median of 20)."""
    if jax.default_backend() == "cpu":
        gib = 0.25
    x = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    f(x).block_until_ready()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / float(np.median(times))


def build_hf(path: str, seed: int = 0):
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(**HF_CONFIG)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3NextForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p, dtype=torch.float32).uniform_(1, 16).log())
            elif name.endswith("dt_bias"):
                p.uniform_(-1, 1)
            elif p.ndim == 1:
                p.normal_(0.0 if "linear_attn.norm" not in name else 1.0, 0.05)
            else:
                p.normal_(0.0, 0.02)
    model.eval()
    model.save_pretrained(path)
    return model


def check_logits(path: str, hf_model, batch_results: list) -> None:
    """jhybrid's prefill logits against HF's on one 128-token prompt, in fp32 (kernel correctness on this
    GPU, in the model) and in bf16 (next to HF's own bf16-vs-fp32 error)."""
    import torch

    from jhybrid.checkpoint import load_model
    from tests.runner_helpers import SequenceRunner

    ids = np.random.default_rng(1).integers(0, HF_CONFIG["vocab_size"], 128).tolist()
    hf = {}
    with torch.no_grad():
        hf["bfloat16"] = hf_model(torch.tensor([ids], device=hf_model.device)).logits[0].float().cpu().numpy()
        hf32 = hf_model.float()
        hf["float32"] = hf32(torch.tensor([ids], device=hf_model.device)).logits[0].float().cpu().numpy()
        hf_model.to(torch.bfloat16)

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    row = {"engine": "check", "hf_bf16_vs_hf_fp32": rel(hf["bfloat16"], hf["float32"])}
    for dtype in ("float32", "bfloat16"):
        cfg, params = load_model(path, dtype=dtype)
        runner = SequenceRunner(cfg, params, max_len=256)
        del params
        table, slot = runner.start()
        got = np.asarray(runner.step(ids, 0, table, slot, all_logits=True), np.float32)
        row[f"jhybrid_{dtype}_vs_hf_{dtype}"] = rel(got, hf[dtype])
        row[f"jhybrid_{dtype}_vs_hf_fp32"] = rel(got, hf["float32"])
        del runner
    log("logit check: " + ", ".join(f"{k} {v:.3e}" for k, v in row.items() if k != "engine"))
    batch_results.append(row)


def decode_device_ms(cfg, params, steps: int = 64) -> float:
    """Batch-1 decode step time with no host work in the loop (steps dispatched back to back)."""
    from tests.runner_helpers import SequenceRunner

    runner = SequenceRunner(cfg, params, max_len=PROMPT + steps + 16)
    table, slot = runner.start()
    logits = runner.step(list(range(PROMPT)), 0, table, slot)
    for i in range(8):
        logits = runner.step([1], PROMPT + i, table, slot)
    jax.block_until_ready(logits)
    t0 = time.perf_counter()
    for i in range(steps):
        logits = runner.step([1], PROMPT + 8 + i, table, slot)
    jax.block_until_ready(logits)
    return (time.perf_counter() - t0) / steps * 1e3


def bench_jhybrid(path: str, batches: list[int], results: list, hf_model=None, json_path=None, extra=None):
    import jhybrid
    from jhybrid.checkpoint import load_model
    from jhybrid.model_loader import LoadedModel
    from jhybrid.models.params import count_params

    t0 = time.perf_counter()
    cfg, params = load_model(path, dtype="bfloat16")
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    log(f"jhybrid: loaded {count_params(params) / 1e9:.2f} B params ({weight_bytes / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s")
    model = LoadedModel(cfg=cfg, params=params)  # packs the projections
    del params
    extra["weight_bytes"] = weight_bytes
    raw = decode_device_ms(cfg, model.params)
    log(f"SequenceRunner (single-sequence helper, host-built batch, full logits) batch-1 step: {raw:.3f} ms")
    results.append({"engine": "jhybrid-raw-step", "batch": 1, "decode_step_ms": raw})
    llm = jhybrid.LLM(model, dtype=None, max_num_seqs=max(batches), max_model_len=PROMPT + NEW + 16,
                      max_num_batched_tokens=8192)
    log(f"KV pool {llm.engine.cache.num_blocks} blocks x {llm.engine.cache.block_size}, {llm.engine.cache.num_slots} slots")
    rng = np.random.default_rng(0)
    params_greedy = jhybrid.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    for i_b, b in enumerate(batches):
        if hf_model is not None and i_b == min(2, len(batches) - 1):  # after the batches the bars need
            check_logits(path, hf_model, results)
        prompts = [rng.integers(0, cfg.vocab_size, PROMPT).tolist() for _ in range(b)]
        eng = llm.engine
        for rep in ("warm-up", "timed"):
            for i, p in enumerate(prompts):
                eng.add_request(f"b{b}-{rep}-{i}", p, params_greedy)
            step_times, t_start = [], time.perf_counter()
            last, pre0 = t_start, eng.num_preemptions
            while eng.has_unfinished():
                decode_only = all(s.num_uncomputed <= 1 for s in eng.scheduler.running) and not eng.scheduler.waiting
                eng.step()
                now = time.perf_counter()
                if decode_only:
                    step_times.append(now - last)
                last = now
            total = time.perf_counter() - t_start
            for i in range(b):
                eng.release(f"b{b}-{rep}-{i}")
        step_ms = float(np.median(step_times[2:])) * 1e3 if len(step_times) > 4 else float("nan")
        tps = b * NEW / total
        log(f"jhybrid batch {b:4d}: {tps:9.1f} tok/s, decode step {step_ms:.3f} ms, wall {total:.2f} s, "
            f"preemptions {eng.num_preemptions - pre0}")
        results.append({"engine": "jhybrid", "batch": b, "tokens_per_s": tps, "decode_step_ms": step_ms, "wall_s": total})
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"results": results, **extra}, f, indent=2)
    return extra


def bench_hf(model, batches: list[int], results: list):
    import torch

    rng = np.random.default_rng(0)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for b in batches:
        ids = torch.tensor(rng.integers(0, HF_CONFIG["vocab_size"], (b, PROMPT)), device=model.device)
        with torch.no_grad():
            model.generate(ids[:, :16], max_new_tokens=4, do_sample=False)  # warm-up
            sync()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            sync()
        total = time.perf_counter() - t0
        log(f"HF      batch {b:4d}: {b * NEW / total:9.1f} tok/s, wall {total:.2f} s")
        results.append({"engine": "hf", "batch": b, "tokens_per_s": b * NEW / total, "wall_s": total})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write {machine_info, results} here")
    parser.add_argument("--batches", default="1,32,128,256")
    parser.add_argument("--hf-batches", default="1,32")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke test on CPU)")
    parser.add_argument("--dir", default=None, help="where to save the HF checkpoint (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.tiny:
        global PROMPT, NEW
        PROMPT, NEW = 32, 8
        HF_CONFIG.update(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, head_dim=16,
                         num_attention_heads=4, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=16)
    info = machine_info()
    log(f"machine: {info['device']} | jax {info['jax']} | commit {info['commit']}")
    bw = copy_bandwidth()
    log(f"copy bandwidth (read + write): {bw / 1e12:.2f} TB/s")
    results: list = []
    path = args.dir or tempfile.mkdtemp(prefix="jh-bench-")
    t0 = time.perf_counter()
    hf_model = build_hf(path)
    log(f"HF model built and saved in {time.perf_counter() - t0:.0f} s")
    hf_batches = [int(b) for b in args.hf_batches.split(",") if b]
    if hf_batches:
        bench_hf(hf_model, hf_batches, results)
    extra = {"machine_info": info, "copy_bw": bw}
    bench_jhybrid(path, [int(b) for b in args.batches.split(",")], results, hf_model, args.json, extra)
    floor_ms = extra["weight_bytes"] / bw * 1e3
    hf = {r["batch"]: r["tokens_per_s"] for r in results if r["engine"] == "hf"}
    log("\n| engine | batch | tokens/s | decode step ms | x floor | x HF |")
    log("|---|---:|---:|---:|---:|---:|")
    for r in results:
        if r["engine"] == "check" or "tokens_per_s" not in r:
            continue
        step = r.get("decode_step_ms")
        ratio = f"{step / floor_ms:.2f}" if step else "-"
        vs_hf = f"{r['tokens_per_s'] / hf[r['batch']]:.1f}" if r["engine"] == "jhybrid" and r["batch"] in hf else "-"
        log(f"| {r['engine']} | {r['batch']} | {r['tokens_per_s']:.1f} | {step if step else '-':.4} | {ratio} | {vs_hf} |"
            if step else f"| {r['engine']} | {r['batch']} | {r['tokens_per_s']:.1f} | - | - | {vs_hf} |")
    log(f"\nbatch-1 decode floor: {extra['weight_bytes'] / 1e9:.2f} GB / {bw / 1e12:.2f} TB/s = {floor_ms:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**extra, "floor_ms": floor_ms, "results": results}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
