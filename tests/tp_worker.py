"""Tensor-parallel checks run in a subprocess with forced host devices (tests/test_tensor_parallel.py).

XLA_FLAGS=--xla_force_host_platform_device_count must be set before JAX starts, so the test spawns
`python -m tests.tp_worker ...`; this prints one JSON object on its last stdout line. Checks:
  * `tokens`: greedy tokens of a few mixed-length prompts through `jhybrid.LLM` at each TP size above 1
    (chunked prefill and decode), per family; at TP 1 (the reference) through `forward` on one device;
  * `fractions`: each device's share of a few parameters and state arrays under TP;
  * `bad_n`: the ValueError message for a tensor_parallel_size that does not divide the head counts;
  * `unpermuted`: logit error when the packed projections are sharded without the shard-major layout
    (the negative control: it must be large);
  * `checkpoints`: `LLM(path, tensor_parallel_size=2)` on HF and converted checkpoints (loaded into host
    memory, then sharded) vs one device; `replicated`: TP 4 over 2 kv heads (each stored twice) vs one device;
  * `from_leaves`: parameters built leaf by leaf into their shards (`shard_params_from`) vs `shard_params`;
  * `pallas`: prefill + decode logits of the Pallas path (interpret mode) per shard under shard_map vs
    the reference path on one device;
  * `swap`: preemption by swap and recompute under TP vs one device; with it, `cached`: prefix caching under TP
    vs one device without the cache;
  * `fp8`: `quantization="fp8"` (FP8 projections and experts) at TP 2 vs TP 1: greedy tokens through `LLM` at TP 2
    vs through `forward` at TP 1, logits through `forward` (the TP engine's own parameters), and each device's share
    of the FP8 weights.
With `--coordinator/--num-processes/--process-id` it first joins a multi-process job (gloo on CPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3", "llama", "minimax", "nemotron_h", "bamba", "granitemoehybrid")
PROMPT_LENGTHS = (3, 21, 30)
NUM_TOKENS = 5


def family_config(name: str, widen: int = 1):
    """A tiny config of `name` whose head counts, groups and intermediate sizes all divide by 4. `widen` multiplies
    every head and group count and the expert count: at `widen=2` each of 4 shards holds two of every kind (two kv
    heads, two GDN key heads, two Mamba2 groups, two experts), which is what TP 2 reaches at `widen=1`."""
    import dataclasses

    cfg = _family_config(name)
    if widen == 1:
        return cfg
    w = lambda n: n * widen  # noqa: E731
    cfg = dataclasses.replace(cfg, num_heads=w(cfg.num_heads), num_kv_heads=w(cfg.num_kv_heads),
                              num_experts=w(cfg.num_experts))
    if cfg.linear_num_key_heads:
        cfg = dataclasses.replace(cfg, linear_num_key_heads=w(cfg.linear_num_key_heads),
                                  linear_num_value_heads=w(cfg.linear_num_value_heads))
    if cfg.mamba_num_heads:
        cfg = dataclasses.replace(cfg, mamba_num_heads=w(cfg.mamba_num_heads), mamba_n_groups=w(cfg.mamba_n_groups))
    return cfg


def _family_config(name: str):
    from jhybrid.config import ModelConfig

    common = dict(model_type=name, vocab_size=128, hidden_size=32, max_position_embeddings=256, rms_norm_eps=1e-6,
                  num_heads=8, num_kv_heads=4, head_dim=16, rotary_dim=16, intermediate_size=32)
    gdn = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=16)
    mamba = dict(mamba_num_heads=8, mamba_head_dim=8, mamba_n_groups=4, ssm_state_size=8)
    lin, full, mam, none = "linear_attention", "full_attention", "mamba2", "none"
    if name == "qwen3_next":
        return ModelConfig(**{**common, "rotary_dim": 4}, **gdn, num_layers=2, layer_kinds=(lin, full),
                           mlp_kinds=("moe",) * 2, norm_zero_centred=True, attn_output_gate=True, qk_norm=True, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
    if name == "qwen3_5":
        return ModelConfig(**{**common, "rotary_dim": 4}, **gdn, num_layers=2, layer_kinds=(lin, full),
                           mlp_kinds=("dense",) * 2, norm_zero_centred=True, attn_output_gate=True, qk_norm=True,
                           tie_word_embeddings=True)
    if name == "qwen3":
        return ModelConfig(**common, num_layers=1, layer_kinds=(full,), mlp_kinds=("dense",), qk_norm=True)
    if name == "llama":
        return ModelConfig(**common, num_layers=1, layer_kinds=(full,), mlp_kinds=("dense",),
                           attention_bias=True, mlp_bias=True)
    if name == "minimax":
        return ModelConfig(**common, num_layers=2, layer_kinds=(full, "lightning_attention"),
                           mlp_kinds=("moe",) * 2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                           full_attn_alpha=1.25, full_attn_beta=0.75, linear_attn_alpha=0.9, linear_attn_beta=1.1,
                           mlp_alpha=1.2, mlp_beta=0.8)
    if name == "nemotron_h":
        return ModelConfig(**{**common, "rotary_dim": 0}, **mamba, num_layers=3, layer_kinds=(mam, none, full),
                           mlp_kinds=(none, "moe", "dense"), mlp_act="relu2", num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                           shared_expert_gate=False, moe_router="sigmoid_group", moe_n_group=2, moe_topk_group=1,
                           routed_scaling_factor=1.5, mamba_norm_eps=1e-5)
    if name == "bamba":
        return ModelConfig(**{**common, "rotary_dim": 8}, **mamba, num_layers=2, layer_kinds=(mam, full),
                           mlp_kinds=("dense",) * 2, mamba_proj_bias=True, attention_bias=True)
    if name == "granitemoehybrid":
        return ModelConfig(**common, **mamba, num_layers=2, layer_kinds=(mam, full), mlp_kinds=("moe",) * 2,
                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                           shared_expert_intermediate_size=24, shared_expert_gate=False, mamba_proj_bias=True,
                           attention_bias=True, embedding_multiplier=12.0, attention_scale=0.015,
                           full_attn_beta=0.22, linear_attn_beta=0.22, mlp_beta=0.22, logits_scaling=6.0)
    raise ValueError(f"unknown family {name!r}; known: {FAMILIES}")


def _model(name: str, seed: int = 0, widen: int = 1):
    from jhybrid.model_loader import LoadedModel
    from jhybrid.models.params import init_params

    cfg = family_config(name, widen)
    return LoadedModel(cfg=cfg, params=init_params(cfg, seed=seed, scale=0.3))


def _prompts(vocab_size: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(1)
    return [rng.integers(0, vocab_size, size=n).tolist() for n in PROMPT_LENGTHS]


def forward_greedy(cfg, params, prompts: list[list[int]], num_tokens: int, **shapes):
    """The one-device reference of the engines' greedy tokens: `num_tokens` greedy tokens of each of `prompts` through
    `forward` (a prefill, then decode steps fed each row's argmax: the two programs an engine would compile, without
    its sampling; `shapes`: `forward_logits`' `prefill_tokens` and `blocks_per_row`). Returns them ([B][num_tokens])
    and the logits ([num_tokens, B, V])."""
    logits = forward_logits(cfg, params, 1, prompts=prompts, decode_steps=num_tokens - 1, feed="greedy", **shapes)
    return logits.argmax(-1).T.tolist(), logits


def reference_tokens(model) -> list[list[int]]:
    """`greedy_tokens`' prompts and tokens on one device, through `forward_greedy`."""
    return forward_greedy(model.cfg, model.params, _prompts(model.cfg.vocab_size), NUM_TOKENS)[0]


def greedy_tokens(model, tp: int) -> tuple[list[list[int]], dict]:
    """`NUM_TOKENS` greedy tokens of each of `PROMPT_LENGTHS`' random prompts through `LLM` at TP `tp`, and each
    device's share of some parameters and state arrays."""
    from jhybrid import LLM, SamplingParams
    from jhybrid.parallel import shard_fraction

    prompts = _prompts(model.cfg.vocab_size)
    llm = LLM(model, **SMALL_POOL_ENGINE, num_kv_blocks=SMALL_POOL_BLOCKS, tensor_parallel_size=tp)  # no pressure here
    outs = llm.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))
    runner = llm.engine.runner
    fractions = {}
    if tp > 1:
        layers = runner.params["layers"]
        for i, layer in enumerate(layers):
            for key, p in layer.items():
                if isinstance(p, dict):
                    for k in ("qkv_proj", "in_proj", "o_proj", "out_proj", "gate_up_proj", "up_proj", "down_proj"):
                        if k in p and f"{key}.{k}" not in fractions:
                            fractions[f"{key}.{k}"] = shard_fraction(p[k])
        fractions["embed"] = shard_fraction(runner.params["embed"])
        state = runner.state  # after the run: still sharded
        if state.k_pages:
            fractions["state.k_pages"] = shard_fraction(state.k_pages[0])
        if state.ssm:
            fractions["state.ssm"] = shard_fraction(state.ssm[0])
            fractions["state.conv"] = shard_fraction(state.conv[-1])
    return [o.token_ids for o in outs], fractions


# the engine shapes of the `tokens`, swap and prefix-cache checks: the swap check's engines (a pool of
# `SMALL_POOL_BLOCKS` blocks of 8, too small for its batch) share their programs with qwen3_next's `tokens` engine;
# the one-device references of the swap and prefix-cache checks (`forward_greedy`: four rows of up to 65 tokens, their
# prompts prefilled in one step) share theirs
SMALL_POOL_ENGINE = dict(dtype=None, max_num_seqs=4, max_model_len=128, block_size=8, max_num_batched_tokens=64)
SMALL_POOL_BLOCKS = 22
SMALL_POOL_REFERENCE = dict(prefill_tokens=192, blocks_per_row=5)


def swap_under_tp(model, tp: int) -> dict:
    """Greedy tokens at TP `tp` with a KV pool too small for the batch, preempting by swap and by recompute,
    against one device without memory pressure (`forward_greedy`); and the engine's preemption counters."""
    import numpy as np

    from jhybrid import LLM, SamplingParams

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.cfg.vocab_size, size=n).tolist() for n in (30, 41, 25, 37)]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    out = {"want": forward_greedy(model.cfg, model.params, prompts, sp.max_tokens, **SMALL_POOL_REFERENCE)[0]}
    for mode in ("swap", "swap-pinned", "recompute"):  # swap-pinned: through pinned_host memory (sharded)
        llm = LLM(model, **SMALL_POOL_ENGINE, num_kv_blocks=SMALL_POOL_BLOCKS, tensor_parallel_size=tp,
                  host_kv_memory_gb=0.01, preemption_mode=mode.removesuffix("-pinned"),
                  swap_transfer="pinned" if mode.endswith("-pinned") else "pageable")
        out[mode] = [o.token_ids for o in llm.generate(prompts, sp)]
        stats = llm.engine.stats()
        out[f"{mode}_preemptions"] = {k: stats[k] for k in ("num_swap_preemptions", "num_recompute_preemptions",
                                                             "num_swap_in")}
    return out


def cached_under_tp(model, tp: int) -> dict:
    """Prefix caching at TP `tp` (sharded KV blocks and state snapshots): prompts that share a 40-token prefix,
    greedy, against one device without the cache (`forward_greedy`); and the prompt tokens the cache served."""
    import numpy as np

    from jhybrid import LLM, SamplingParams

    rng = np.random.default_rng(3)
    shared = rng.integers(0, model.cfg.vocab_size, size=40).tolist()
    prompts = [shared + rng.integers(0, model.cfg.vocab_size, size=n).tolist() for n in (3, 9, 14, 6)]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = forward_greedy(model.cfg, model.params, prompts, sp.max_tokens, **SMALL_POOL_REFERENCE)[0]  # swap's
    llm = LLM(model, **SMALL_POOL_ENGINE, tensor_parallel_size=tp, enable_prefix_caching=True, num_kv_blocks=40,
              prefix_snapshot_slots=4)  # (with the cache on, the pool would take the whole memory budget)
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    return {"equal": got == want, "tokens": got, "hits": llm.engine.stats()["prefix_cache_hits"]}


def _prefill_batch(cfg, lengths, block_size=16, max_blocks=4, seed=2):
    import jax.numpy as jnp
    import numpy as np

    from jhybrid.models.batch import RowSpec, make_batch

    rng = np.random.default_rng(seed)
    rows = [RowSpec(rng.integers(0, cfg.vocab_size, n).tolist(), 0, list(range(1 + i * max_blocks, 1 + (i + 1) * max_blocks)), i + 1)
            for i, n in enumerate(lengths)]
    batch = make_batch(rows, block_size=block_size, max_blocks_per_seq=max_blocks, num_tokens=64, num_rows=len(rows))
    return jax_tree_map(jnp.asarray, batch), rows


def jax_tree_map(fn, tree):
    import jax

    return jax.tree.map(fn, tree)


@functools.lru_cache(maxsize=None)
def _forward_step(kernel_impl: str, interpret: bool, mesh):
    """One jitted `forward` per kernel choice and mesh, so that calls of `forward_logits` with the same shapes share
    its compiled programs."""
    import jax

    from jhybrid.models.hybrid import forward

    return jax.jit(functools.partial(forward, kernel_impl=kernel_impl, interpret=interpret, mesh=mesh),
                   static_argnames=("cfg", "decode"))


def forward_logits(cfg, packed, tp: int, *, permute: bool = True, kernel_impl="reference", interpret=False,
                   lengths=(5, 37), decode_steps: int = 2, prompts=None, feed=None, placed: bool = False,
                   prefill_tokens: int = 64, blocks_per_row: int = 4):
    """Prefill logits [B, V] then `decode_steps` decode logits, through `forward` on a `tp` mesh. The prompts are
    `prompts` (token lists) or random ones of `lengths`, prefilled in one step of `prefill_tokens` tokens, each row
    with `blocks_per_row` KV blocks of 16; each decode step feeds one token per row: the rows of `feed`
    ([decode_steps, B] token ids), `"greedy"` (each row's argmax of the last logits) or random ones. `placed`:
    `packed` is already in the shard-major layout on the mesh (an engine runner's `params`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding

    from jhybrid import parallel
    from jhybrid.cache.state import CacheConfig, init_state
    from jhybrid.models.batch import RowSpec, make_batch

    rng = np.random.default_rng(2)
    tokens = prompts or [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    m = blocks_per_row
    cache = CacheConfig(num_blocks=1 + m * len(tokens), block_size=16, num_slots=len(tokens) + 1, kv_dtype="float32")
    mesh = parallel.make_mesh(tp) if tp > 1 else None
    if mesh is None:
        params, state = packed, init_state(cfg, cache)
    elif placed:
        params, state = packed, parallel.init_sharded_state(cfg, cache, mesh)
    elif permute:
        params, state = parallel.shard_params(cfg, packed, mesh), parallel.init_sharded_state(cfg, cache, mesh)
    else:  # negative control: the right specs on the single-device packed layout
        specs = parallel.param_specs(cfg, packed, tp)
        params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), packed, specs,
                              is_leaf=lambda x: isinstance(x, jax.Array))
        state = parallel.init_sharded_state(cfg, cache, mesh)
    step = _forward_step(kernel_impl, interpret, mesh)
    tables = [list(range(1 + i * m, 1 + (i + 1) * m)) for i in range(len(tokens))]
    out = []
    rows = [RowSpec(t, 0, tables[i], i + 1) for i, t in enumerate(tokens)]
    batch = jax.tree.map(jnp.asarray, make_batch(rows, block_size=16, max_blocks_per_seq=m, num_tokens=prefill_tokens,
                                                 num_rows=len(rows)))
    logits, state = step(cfg, params, state, batch, decode=False)
    out.append(np.asarray(logits))
    for s in range(decode_steps):
        if feed is None:
            fed = [int(rng.integers(0, cfg.vocab_size)) for _ in tokens]
        else:
            fed = out[-1].argmax(-1).tolist() if isinstance(feed, str) else [int(t) for t in feed[s]]
        rows = [RowSpec([fed[i]], len(t) + s, tables[i], i + 1) for i, t in enumerate(tokens)]
        batch = jax.tree.map(jnp.asarray, make_batch(rows, block_size=16, max_blocks_per_seq=m, num_tokens=len(rows),
                                                     num_rows=len(rows)))
        logits, state = step(cfg, params, state, batch, decode=True)
        out.append(np.asarray(logits))
    return np.stack(out)


def sharded_from_leaves(cfg, params, tp: int) -> dict:
    """`shard_params_from` (each packed leaf made on demand from a stand-in with a `.shape`) against
    `shard_params` on the whole packed pytree: the leaves whose values or shardings differ, and how many
    leaves `make_leaf` was asked for."""
    import jax
    import numpy as np

    from jhybrid.parallel import make_mesh, shard_params, shard_params_from

    class Stand:
        def __init__(self, value):
            self.value, self.shape = value, value.shape

    packed = params  # the runtime (packed) layout, as `forward_logits` takes it
    mesh = make_mesh(tp)
    calls = []
    make = lambda s: calls.append(1) or s.value  # noqa: E731
    got = shard_params_from(cfg, jax.tree.map(Stand, packed), mesh, make)
    want = shard_params(cfg, packed, mesh)
    bad = [jax.tree_util.keystr(path) for (path, g), w in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want),
                                                              strict=True)
           if g.sharding != w.sharding or not np.array_equal(np.asarray(g), np.asarray(w))]
    return {"mismatched": bad, "leaves": len(jax.tree.leaves(want)), "made": len(calls)}


def from_checkpoints(tp: int) -> dict:
    """`LLM(path, tensor_parallel_size=tp)` on an HF and a converted checkpoint: the parameters are read
    into host memory (`load(..., host=True)`) and go from there to their shards. Greedy tokens of each
    against one device on the HF directory (`forward_greedy`), and the devices the loaded (unsharded) parameters
    sit on."""
    import tempfile

    import jax

    from converters.convert import convert
    from jhybrid import LLM, SamplingParams
    from jhybrid.model_loader import load
    from tests.example_ckpt import write_example_checkpoint

    out: dict = {}
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[1, 5, 9, 2, 7], list(range(3, 40))]
    with tempfile.TemporaryDirectory() as tmp:
        hf = write_example_checkpoint(os.path.join(tmp, "hf"))
        converted = convert(hf, os.path.join(tmp, "converted"), dtype="float32", progress=False)
        kw = dict(dtype="float32", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=64)
        loaded = load(hf, "float32")  # the converted copy holds the same fp32 values
        one = forward_greedy(loaded.cfg, loaded.params, prompts, sp.max_tokens)[0]
        for name, path in (("hf", hf), ("converted", converted)):
            many = [o.token_ids for o in LLM(path, tensor_parallel_size=tp, **kw).generate(prompts, sp)]
            host = load(path, "float32", host=True)
            platforms = sorted({d.platform for x in jax.tree.leaves(host.params) for d in x.devices()})
            out[name] = {"equal": one == many, "tokens": many, "loaded_on": platforms}
    return out


def replicated_kv(tp: int) -> dict:
    """A qwen3_next model with 2 kv heads at TP `tp` (> 2: each kv head is stored tp / 2 times) against one device
    (`forward_greedy`): greedy tokens, the engine's kv head count and each device's share of the KV pages."""
    import dataclasses

    from jhybrid import LLM, SamplingParams
    from jhybrid.model_loader import LoadedModel
    from jhybrid.models.params import init_params
    from jhybrid.parallel import shard_fraction

    cfg = dataclasses.replace(family_config("qwen3_next"), num_kv_heads=2)
    model = LoadedModel(cfg=cfg, params=init_params(cfg, seed=0, scale=0.3))
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[1, 5, 9, 2, 7], list(range(3, 40))]
    one = forward_greedy(cfg, model.params, prompts, sp.max_tokens)[0]
    llm = LLM(model, dtype=None, max_num_seqs=2, max_model_len=64, max_num_batched_tokens=64, tensor_parallel_size=tp)
    return {"equal": one == [o.token_ids for o in llm.generate(prompts, sp)], "tp": tp,
            "num_kv_heads": llm.engine.runner.cfg.num_kv_heads,
            "kv_page_share": shard_fraction(llm.engine.runner.state.k_pages[0])}


def fp8_config():
    """A minimax-shaped model whose projections and experts all split 2 ways on whole 128-blocks: hidden size 128,
    2 query and 2 kv heads of 128 (the packed qkv's segments 256 | 256 | 256), lightning in_proj segments 768 | 256,
    4 experts of width 128."""
    import dataclasses

    return dataclasses.replace(family_config("minimax"), hidden_size=128, num_heads=2, num_kv_heads=2, head_dim=128,
                               moe_intermediate_size=128)


def fp8_under_tp(tp: int) -> dict:
    """`quantization="fp8"` at TP `tp` on `fp8_config`'s model against one device: the greedy tokens through `LLM`
    against TP 1's greedy tokens through `forward` (on `quantize(model, "fp8")`); the relative error of the prefill
    and decode logits of `forward` run on the TP engine's own FP8 parameters (per shard under shard_map), fed TP 1's
    greedy tokens, against TP 1's; how many FP8 weights each holds; each device's share of an FP8 expert stack and of
    the FP8 column- and row-parallel projections (values and scales)."""
    from jhybrid import LLM, SamplingParams
    from jhybrid.model_loader import LoadedModel, quantize
    from jhybrid.models.params import init_params
    from jhybrid.models.quant import num_fp8_weights
    from jhybrid.parallel import shard_fraction

    cfg = fp8_config()
    model = LoadedModel(cfg=cfg, params=init_params(cfg, seed=0, scale=0.1))
    num_tokens = 6
    sp = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[1, 5, 9, 2, 7], list(range(3, 40))]
    llm = LLM(model, dtype=None, max_num_seqs=2, max_model_len=64, max_num_batched_tokens=64, quantization="fp8",
              tensor_parallel_size=tp)
    many = [o.token_ids for o in llm.generate(prompts, sp)]
    runner = llm.engine.runner
    full, lightning = runner.params["layers"]
    shares = {name: [shard_fraction(w.w), shard_fraction(w.scale)] for name, w in (
        ("experts", full["mlp"]["gate_up_proj"]), ("attn.qkv_proj", full["attn"]["qkv_proj"]),
        ("attn.o_proj", full["attn"]["o_proj"]), ("lightning.in_proj", lightning["lightning"]["in_proj"]))}
    one_q = quantize(model, "fp8")
    # TP 1 decodes greedily; the TP engine's parameters are fed the same tokens, so each step's logits compare
    one, want = forward_greedy(cfg, one_q.params, prompts, num_tokens)
    got = forward_logits(runner.cfg, runner.params, tp, prompts=prompts, decode_steps=num_tokens - 1,
                         feed=want.argmax(-1)[:-1], placed=True)
    return {"tp": tp, "equal": one == many, "tokens": many, "want": one, "logits": _rel(got, want), "shares": shares,
            "num_fp8": [num_fp8_weights(one_q.params), num_fp8_weights(runner.params)]}


def _rel(a, b) -> float:
    import numpy as np

    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--tp", default="1,4")
    ap.add_argument("--checks", default="tokens,bad_n,unpermuted,pallas,swap,checkpoints,replicated")
    ap.add_argument("--widen", type=int, default=2, help="head, group and expert multiplier of the `tokens` models")
    ap.add_argument("--coordinator")
    ap.add_argument("--num-processes", type=int)
    ap.add_argument("--process-id", type=int)
    args = ap.parse_args(argv)

    from jhybrid.parallel import init_distributed

    init_distributed(args.coordinator, args.num_processes, args.process_id)
    import jax

    jax.config.update("jax_enable_x64", False)
    result: dict = {"devices": jax.device_count(), "processes": jax.process_count(), "timings": {}}
    checks = set(args.checks.split(","))
    sizes = [int(t) for t in args.tp.split(",")]
    if "tokens" in checks:
        result["tokens"], result["fractions"] = {}, {}
        for name in args.families.split(","):
            t0 = time.perf_counter()
            model = _model(name, widen=args.widen)
            result["tokens"][name] = {}
            for tp in sizes:
                toks, fractions = (reference_tokens(model), {}) if tp == 1 else greedy_tokens(model, tp)
                result["tokens"][name][str(tp)] = toks
                if fractions:
                    result["fractions"][f"{name}/{tp}"] = fractions
            result["timings"][name] = round(time.perf_counter() - t0, 2)
            jax.clear_caches()
    if "bad_n" in checks:
        from jhybrid import LLM

        try:
            LLM(_model("qwen3_next"), dtype=None, max_num_seqs=2, max_model_len=32, num_kv_blocks=8,
                tensor_parallel_size=3)
            result["bad_n"] = None
        except ValueError as e:
            result["bad_n"] = str(e)
    if "unpermuted" in checks or "pallas" in checks:
        t0 = time.perf_counter()
        model = _model("qwen3_5")  # Gated DeltaNet + paged attention: both have Pallas kernels
        want = forward_logits(model.cfg, model.params, 1, decode_steps=1)  # one device, the reference kernels
        result["timings"]["reference"] = round(time.perf_counter() - t0, 2)
    if "unpermuted" in checks:
        t0 = time.perf_counter()
        right = forward_logits(model.cfg, model.params, 2, decode_steps=0)
        wrong = forward_logits(model.cfg, model.params, 2, permute=False, decode_steps=0)
        result["unpermuted"] = {"right": _rel(right, want[:1]), "wrong": _rel(wrong, want[:1])}  # the prefill
        result["from_leaves"] = sharded_from_leaves(model.cfg, model.params, max(sizes))
        result["timings"]["unpermuted"] = round(time.perf_counter() - t0, 2)
    if "pallas" in checks:
        t0 = time.perf_counter()
        tp = max(sizes)
        got = forward_logits(model.cfg, model.params, tp, kernel_impl="pallas", interpret=True, decode_steps=1)
        result["pallas"] = {"tp": tp, "vs_one_device": _rel(got, want)}
        result["timings"]["pallas"] = round(time.perf_counter() - t0, 2)
    if "checkpoints" in checks:
        t0 = time.perf_counter()
        result["checkpoints"] = from_checkpoints(2)  # the example checkpoint has 2 kv heads
        result["timings"]["checkpoints"] = round(time.perf_counter() - t0, 2)
    if "replicated" in checks:
        t0 = time.perf_counter()
        result["replicated"] = replicated_kv(max(sizes))
        result["timings"]["replicated"] = round(time.perf_counter() - t0, 2)
    if "swap" in checks:
        t0 = time.perf_counter()
        model = _model("qwen3_next", widen=args.widen)  # the `tokens` check's model: its programs
        result["swap"] = swap_under_tp(model, max(sizes))
        result["cached"] = cached_under_tp(model, max(sizes))
        result["timings"]["swap"] = round(time.perf_counter() - t0, 2)
    if "fp8" in checks:
        t0 = time.perf_counter()
        result["fp8"] = fp8_under_tp(2)
        result["timings"]["fp8"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
