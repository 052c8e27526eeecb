"""Tensor-parallel scaling: decode and prefill step throughput on 1 and N GPUs (JAX sharding, XLA SPMD).

    PYTHONPATH=. python -m benchmarks.tp [--tp-sizes 1,2] [--models 2b,moe] [--json out.json]
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu PYTHONPATH=. python -m benchmarks.tp --tiny

Models (random bf16 weights, generated on the device; no checkpoint needed):
  * `2b`:  the 2.2 B Qwen3-Next-shaped dense hybrid of benchmarks/generate.py (hidden 2048, 24 layers, every
    4th full attention with 16 q / 2 kv heads of 256, Gated DeltaNet 16 key / 32 value heads of 128,
    intermediate 5632, vocab 151936);
  * `moe`: a random-weight model shaped like Qwen3.5-35B-A3B as published (hidden 2048, 40 layers, every 4th
    full attention with 16 q / 2 kv heads of 256, Gated DeltaNet 16 key / 32 value heads of 128, 256
    experts of 512 with top-8 routing plus a shared expert of 512, vocab 248320): about 35 B parameters.

For each model and TP size, in one run: the decode step at batch 1 and 64 (one token per row over a
context of `--context` tokens already in the KV pages: the attention reads that many pages, the linear
state is its fixed size), and a prefill of `--prefill` tokens in one step. The model runs through
`jhybrid.models.forward` jitted with the sharded parameters and state (kernels "auto": Pallas per shard on
GPUs). Times are medians (p20/p80) after warm-up. Correctness gates the speed: each TP > 1 run first checks
its prefill logits against TP 1 on the same weights (made in their shards by `jhybrid.parallel.shard_params_from`).
Memory: from each device's free memory after the weights, the largest batch at `--context` tokens and the
longest context at batch 64 that the KV pool and state slots could hold.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.cache.state import CacheConfig, init_state
from jhybrid.config import ModelConfig
from jhybrid.models.batch import RowSpec, make_batch
from jhybrid.models.hybrid import forward
from jhybrid.models.params import is_shape, pack_params, param_shapes
from jhybrid.parallel import init_sharded_state, make_mesh, shard_params, shard_params_from


def _layer_kinds(num_layers: int) -> tuple[str, ...]:
    """Every 4th layer full attention, the others Gated DeltaNet."""
    return tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers))


def _hybrid(num_layers: int, **kw) -> ModelConfig:
    kinds = _layer_kinds(num_layers)
    mlp = "moe" if kw.get("num_experts") else "dense"
    base = dict(model_type="qwen3_next", num_layers=num_layers, layer_kinds=kinds, mlp_kinds=(mlp,) * num_layers,
                norm_zero_centred=True, attn_output_gate=True, qk_norm=True, max_position_embeddings=65536,
                dtype="bfloat16")
    return ModelConfig(**{**base, **kw})


def model_config(name: str, tiny: bool) -> ModelConfig:
    if tiny:  # the same structure, small: a CPU smoke test
        common = dict(vocab_size=512, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=4,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
        if name == "2b":
            return _hybrid(4, **common, intermediate_size=128)
        return _hybrid(4, **common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32)
    common = dict(hidden_size=2048, num_heads=16, num_kv_heads=2, head_dim=256, rotary_dim=64, linear_num_key_heads=16,
                  linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128)
    if name == "2b":
        return _hybrid(24, **common, vocab_size=151936, intermediate_size=5632)
    if name == "moe":
        return _hybrid(40, **common, vocab_size=248320, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                       shared_expert_intermediate_size=512)
    raise ValueError(f"unknown model {name!r}; choose 2b or moe")


@dataclasses.dataclass(frozen=True)
class _LeafSpec:
    name: str
    shape: tuple
    index: int


def random_params(cfg: ModelConfig, seed: int = 0, mesh=None) -> dict:
    """Packed random bf16 parameters, one leaf at a time: on the default device, or with `mesh` straight
    into their shards (the same values; no device holds the whole model)."""
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16), param_shapes(cfg), is_leaf=is_shape)
    packed = jax.eval_shape(pack_params, shapes)
    leaves, tree = jax.tree.flatten_with_path(packed)
    specs = jax.tree.unflatten(tree, [_LeafSpec(jax.tree_util.keystr(path), tuple(sds.shape), i)
                                      for i, (path, sds) in enumerate(leaves)])
    make = lambda s: _leaf(s.name, s.shape, jax.random.fold_in(jax.random.key(seed), s.index))  # noqa: E731
    if mesh is None:
        return jax.tree.map(make, specs)
    return shard_params_from(cfg, specs, mesh, make)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _leaf_jit(kind: str, shape: tuple, key):
    if kind == "A_log":
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(jnp.bfloat16)
    if kind == "dt_bias":
        return jax.random.uniform(key, shape, jnp.float32, -1.0, 1.0).astype(jnp.bfloat16)
    if kind == "norm":
        return (0.05 * jax.random.normal(key, shape, jnp.float32)).astype(jnp.bfloat16)
    fan_in = shape[-2] if len(shape) >= 2 else 1
    return (jax.random.normal(key, shape, jnp.float32) / np.sqrt(fan_in)).astype(jnp.bfloat16)


def _leaf(name: str, shape, key):
    kind = "A_log" if "A_log" in name else "dt_bias" if "dt_bias" in name else "norm" if "norm" in name else "w"
    return _leaf_jit(kind, tuple(shape), key)


def _step_fn(mesh):
    return jax.jit(functools.partial(forward, mesh=mesh), static_argnames=("cfg", "decode"), donate_argnames=("state",))


def _state(cfg, cache, mesh):
    return init_state(cfg, cache) if mesh is None else init_sharded_state(cfg, cache, mesh)


def _timeit(fn, iters: int) -> dict:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    p20, p50, p80 = np.percentile(times, [20, 50, 80])
    return {"median_ms": p50 * 1e3, "p20_ms": p20 * 1e3, "p80_ms": p80 * 1e3}


def decode_bench(cfg, params, mesh, batch: int, context: int, block_size: int, iters: int) -> dict:
    blocks = -(-(context + 1) // block_size)
    cache = CacheConfig(num_blocks=batch * blocks + 1, block_size=block_size, num_slots=batch + 1, kv_dtype="bfloat16")
    state = _state(cfg, cache, mesh)
    rows = [RowSpec([1], context, list(range(1 + r * blocks, 1 + (r + 1) * blocks)), r + 1) for r in range(batch)]
    b = jax.tree.map(jnp.asarray, make_batch(rows, block_size=block_size, max_blocks_per_seq=blocks))
    step = _step_fn(mesh)
    box = [state]

    def run():
        logits, box[0] = step(cfg, params, box[0], b, decode=True)
        logits.block_until_ready()

    run(), run()
    t = _timeit(run, iters)
    return {**t, "tokens_per_s": batch / (t["median_ms"] / 1e3)}


def prefill_logits(cfg, params, mesh, tokens: int, block_size: int, seed: int = 0):
    blocks = -(-tokens // block_size)
    cache = CacheConfig(num_blocks=blocks + 1, block_size=block_size, num_slots=2, kv_dtype="bfloat16")
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, tokens).tolist()
    b = jax.tree.map(jnp.asarray, make_batch([RowSpec(ids, 0, list(range(1, blocks + 1)), 1)], block_size=block_size,
                                              max_blocks_per_seq=blocks))
    step = _step_fn(mesh)
    return cache, b, step


def prefill_bench(cfg, params, mesh, tokens: int, block_size: int, iters: int) -> tuple[dict, np.ndarray]:
    cache, b, step = prefill_logits(cfg, params, mesh, tokens, block_size)
    box = [None, _state(cfg, cache, mesh)]  # the state is made once, outside the timing, and reused (donated)

    def run():
        logits, box[1] = step(cfg, params, box[1], b, decode=False)
        box[0] = logits.block_until_ready()

    run()
    t = _timeit(run, iters)
    return {**t, "tokens_per_s": tokens / (t["median_ms"] / 1e3)}, np.asarray(box[0], np.float32)


def memory_fit(cfg, params, mesh, context: int) -> dict:
    """Largest batch at `context` and longest context at batch 64: 90% of device 0's memory less its share
    of these parameters."""
    n = 1 if mesh is None else mesh.size
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return {"max_batch_at_context": None, "max_context_at_batch64": None}
    on_dev0 = sum(next(s.data.nbytes for s in x.addressable_shards if s.device == jax.devices()[0])
                  for x in jax.tree.leaves(params))
    free = 0.9 * stats["bytes_limit"] - on_dev0
    per_token = cfg.kv_bytes_per_token(2) / n
    per_seq = cfg.state_bytes_per_sequence() / n
    return {"weights_gb_per_device": on_dev0 / 1e9, "max_batch_at_context": int(free // (context * per_token + per_seq)),
            "max_context_at_batch64": int((free / 64 - per_seq) // per_token)}


def check_logits(cfg, params, mesh, tokens: int, block_size: int) -> np.ndarray:
    """Logits of every token of one prefill (for the TP-N vs TP-1 check)."""
    cache, b, _ = prefill_logits(cfg, params, mesh, tokens, block_size, seed=1)
    f = jax.jit(functools.partial(forward, mesh=mesh, all_logits=True), static_argnames=("cfg", "decode"))
    return np.asarray(f(cfg, params, _state(cfg, cache, mesh), b, decode=False)[0], np.float32)


def truncated(cfg: ModelConfig, num_layers: int) -> ModelConfig:
    """The same shapes with the first `num_layers` layers: the correctness check's model. A deep random-weight
    routed MoE in bf16 is chaotic (one flipped expert choice changes the token's output, and 40 layers flip
    most tokens): on the CPU, at this model's depth and expert count with a small hidden size, bf16 at TP 1
    is 0.82 (median per-token) from the same weights in fp32 while fp32 TP 2 vs TP 1 is 1e-4
    (`--routing-chaos 40`), so a
    full-depth bf16 comparison cannot tell a layout bug from routing flips. A few layers can."""
    if num_layers >= cfg.num_layers:
        return cfg
    return dataclasses.replace(cfg, num_layers=num_layers, layer_kinds=cfg.layer_kinds[:num_layers],
                               mlp_kinds=cfg.mlp_kinds[:num_layers])


def routing_chaos(num_layers: int, tokens: int = 128) -> dict:
    """The tiny `moe` shape at `num_layers` layers with 256 experts, top 8: median per-token logits error of
    bf16 TP 1 vs fp32, bf16 TP 2 vs fp32 and fp32 TP 2 vs TP 1 (needs 2 devices; CPU is fine)."""
    cfg = dataclasses.replace(model_config("moe", True), num_layers=num_layers, layer_kinds=_layer_kinds(num_layers),
                              mlp_kinds=("moe",) * num_layers, num_experts=256, num_experts_per_tok=8)
    f32 = dataclasses.replace(cfg, dtype="float32")
    base = random_params(cfg)
    base32 = jax.tree.map(lambda x: x.astype(jnp.float32), base)
    mesh = make_mesh(2)
    run = lambda c, p, m: check_logits(c, p if m is None else shard_params(c, p, m), m, tokens, 16)  # noqa: E731
    ref = run(f32, base32, None)
    med = lambda a, b: float(np.median(np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)))  # noqa: E731
    return {"bf16_tp1_vs_fp32": med(run(cfg, base, None), ref), "bf16_tp2_vs_fp32": med(run(cfg, base, mesh), ref),
            "fp32_tp2_vs_tp1": med(run(f32, base32, mesh), ref)}


def link_bench(n: int) -> dict:
    """The all-reduce over the `n`-device mesh (XLA over NCCL), bf16 and fp32, of a decode-sized [64, 2048]
    and a prefill-sized [8192, 2048] activation: ms and the algorithm bandwidth (bytes / time)."""
    mesh = make_mesh(n)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tp"))
    out = {}
    for rows in (64, 8192):
        for dt in (jnp.bfloat16, jnp.float32):
            x = jax.device_put(jnp.ones((n, rows, 2048), dt), spec)
            f = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "tp"), mesh=mesh, in_specs=jax.sharding.PartitionSpec("tp"),
                                      out_specs=jax.sharding.PartitionSpec("tp")))
            f(x).block_until_ready()
            t = _timeit(lambda: f(x).block_until_ready(), 20)
            nbytes = rows * 2048 * jnp.dtype(dt).itemsize
            out[f"allreduce_{rows}x2048_{jnp.dtype(dt).name}"] = {**t, "gb_per_s": nbytes / (t["median_ms"] / 1e3) / 1e9}
    return out


def collectives(cfg, params, mesh, block_size: int, prefill_tokens: int = 0) -> dict:
    """The collectives XLA put into one decode step (batch 4), or with `prefill_tokens` into one prefill step
    of that many tokens: op and shape -> count."""
    import collections
    import re

    if prefill_tokens:
        cache, b, step = prefill_logits(cfg, params, mesh, prefill_tokens, block_size)
    else:
        blocks = 4
        cache = CacheConfig(num_blocks=4 * blocks + 1, block_size=block_size, num_slots=5, kv_dtype="bfloat16")
        rows = [RowSpec([1], 40, list(range(1 + r * blocks, 1 + (r + 1) * blocks)), r + 1) for r in range(4)]
        b = jax.tree.map(jnp.asarray, make_batch(rows, block_size=block_size, max_blocks_per_seq=blocks))
        step = _step_fn(mesh)
    txt = step.lower(cfg, params, _state(cfg, cache, mesh), b, decode=not prefill_tokens).compile().as_text()
    ops = collections.Counter()
    for line in txt.splitlines():
        # the result type is one array or, where XLA combined or wrapped collectives, a (nested) tuple
        m = re.match(r"\s*(?:ROOT )?\S+ = (.+?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
                     r"(-start)?\(", line)
        if m:
            ops[f"{m.group(2)} {m.group(1)}"] += 1
    return dict(ops)


def machine_info() -> dict:
    from benchmarks.provenance import git_commit

    return {"device": jax.devices()[0].device_kind, "num_devices": jax.device_count(), "jax": jax.__version__,
            "commit": git_commit()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="2b,moe")
    ap.add_argument("--tp-sizes", default="1,2")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=None, help="decode context (default 2048; 48 with --tiny)")
    ap.add_argument("--prefill", type=int, default=None, help="prefill tokens (default 8192; 64 with --tiny)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--check-tokens", type=int, default=None, help="prefill tokens of the TP-N vs TP-1 logits check "
                    "(default 512; 64 with --tiny)")
    ap.add_argument("--check-layers", type=int, default=4, help="layers of the same-shaped model whose TP-N logits are "
                    "checked against TP 1 (default 4: see `truncated`)")
    ap.add_argument("--routing-chaos", type=int, default=None, metavar="LAYERS",
                    help="only measure how far bf16 drifts from fp32 in a tiny LAYERS-deep 256-expert top-8 MoE, "
                    "at TP 1 and 2, and exit (CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    ap.add_argument("--link", action="store_true", help="also time all-reduces over the mesh (the link's bandwidth)")
    ap.add_argument("--tiny", action="store_true", help="small models and sizes: a CPU smoke test")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    context = args.context or (48 if args.tiny else 2048)
    prefill = args.prefill or (64 if args.tiny else 8192)
    iters = args.iters or (3 if args.tiny else 20)
    batches = [int(b) for b in args.batches.split(",")]
    if args.tiny and args.batches == "1,64":
        batches = [1, 4]
    sizes = [int(n) for n in args.tp_sizes.split(",")]
    info = machine_info()
    print(f"# {info['device']} x{info['num_devices']}  jax {info['jax']}  commit {info['commit']}", flush=True)
    args.check_tokens = args.check_tokens or (64 if args.tiny else 512)
    if args.routing_chaos:
        print(json.dumps(routing_chaos(args.routing_chaos)))
        return 0
    if args.link:
        for n in sizes:
            if n > 1:
                info[f"link_tp{n}"] = link_bench(n)
                print(f"link tp{n}: " + json.dumps(info[f"link_tp{n}"]), flush=True)
    results = []
    for name in args.models.split(","):
        cfg = model_config(name, args.tiny)
        check_cfg = truncated(cfg, args.check_layers)
        reference = None
        for n in sizes:
            mesh = make_mesh(n) if n > 1 else None
            params = random_params(cfg, 0, mesh)  # made in its shards: only this TP size's copy exists
            row = {"model": name, "tp": n, **memory_fit(cfg, params, mesh, context)}
            row["prefill"], _ = prefill_bench(cfg, params, mesh, prefill, args.block_size, max(2, iters // 4))
            check_params = random_params(check_cfg, 1, mesh) if check_cfg is not cfg else params
            logits = check_logits(check_cfg, check_params, mesh, args.check_tokens, args.block_size)
            row["check_layers"] = check_cfg.num_layers
            del check_params
            if reference is None:
                reference = logits
            # per token: bf16 weights and another reduction order; a routed MoE in bf16 also flips a few
            # tokens' experts (random weights amplify a flip), so the gate is the median token, and the share
            # of tokens off by > 0.2 is reported (TP 1 bf16 vs fp32 shows the same share on CPU)
            err = np.linalg.norm(logits - reference, axis=-1) / np.linalg.norm(reference, axis=-1)
            row["logits_rel_err"] = float(np.median(err))
            row["logits_rel_err_p90"] = float(np.quantile(err, 0.9))
            row["tokens_off_by_0.2"] = float(np.mean(err > 0.2))
            row["correct"] = row["logits_rel_err"] < 5e-2
            if n > 1:
                row["collectives_decode"] = collectives(cfg, params, mesh, args.block_size)
                row["collectives_prefill"] = collectives(cfg, params, mesh, args.block_size, prefill)
            for b in batches:
                row[f"decode_b{b}"] = decode_bench(cfg, params, mesh, b, context, args.block_size, iters)
            results.append(row)
            print("row " + json.dumps(row), flush=True)  # as it lands: a run cut short keeps what it measured
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"machine_info": info, "config": vars(args), "results": results}, f, indent=2)
            del params
    print(f"{'model':6} {'tp':>3} {'ok':>3} {'prefill ms':>11} {'prefill tok/s':>14} " +
          " ".join(f"{'dec b' + str(b) + ' ms':>12} {'tok/s':>9}" for b in batches) + f" {'maxB@ctx':>9} {'maxctx@64':>10}")
    for r in results:
        one = next(x for x in results if x["model"] == r["model"] and x["tp"] == sizes[0])
        dec = " ".join(f"{r[f'decode_b{b}']['median_ms']:12.3f} {r[f'decode_b{b}']['tokens_per_s']:9.1f}" for b in batches)
        print(f"{r['model']:6} {r['tp']:>3} {'yes' if r['correct'] else 'NO':>3} {r['prefill']['median_ms']:11.2f} "
              f"{r['prefill']['tokens_per_s']:14.0f} {dec} {str(r['max_batch_at_context']):>9} "
              f"{str(r['max_context_at_batch64']):>10}")
        if r is not one and r["correct"]:
            scale = {f"decode_b{b}": one[f"decode_b{b}"]["median_ms"] / r[f"decode_b{b}"]["median_ms"] for b in batches}
            scale["prefill"] = one["prefill"]["median_ms"] / r["prefill"]["median_ms"]
            r["speedup_vs_tp1"] = scale
            print("       speedup vs TP " + str(sizes[0]) + ": " + ", ".join(f"{k} {v:.2f}x" for k, v in scale.items()))
        elif not r["correct"]:
            print(f"       logits differ from TP {sizes[0]} (rel err {r['logits_rel_err']:.3e}): no speedup reported")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine_info": info, "config": vars(args), "results": results}, f, indent=2)
    return 0 if all(r["correct"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
