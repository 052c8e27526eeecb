"""Tensor-parallel (Megatron-style) sharding of the packed parameters and of the state pytree.

Over a 1-D mesh of N devices (axis "tp"):

  * column-parallel in: the packed input projections (attention `qkv_proj`, Gated DeltaNet / lightning /
    Mamba2 `in_proj`, MLP `gate_up_proj` / `up_proj`) are split along their output axis, stored
    shard-major (`jhybrid.parallel.layout`) so shard i holds whole heads (q, k, v of the same heads; the
    gate and up halves of the same intermediate channels);
  * row-parallel out: `o_proj`, `out_proj`, `down_proj` are split along their input axis; XLA SPMD inserts
    the all-reduce after them;
  * per-head vectors (`dt_bias`, `A_log`, Mamba2 `D` and norm, lightning norm) and the causal conv weights
    are split with their heads / channels;
  * routed experts are split along the expert axis when N divides their number, else replicated;
  * the embedding and the LM head are split along the vocabulary when N divides it, else replicated;
    sampling runs on gathered logits;
  * norms, routers and the remaining biases are replicated;
  * FP8 weights (`jhybrid.models.quant.Fp8Weight`, `[..., N, K]` blocks) split as the weights they hold, their
    values and block scales alike, block by block: a split must fall on whole 128-blocks (`fp8_splittable`:
    `quantize_params` leaves the other projections in the load dtype), and a packed projection is permuted
    shard-major by whole blocks, so each device holds the single-device model's FP8 blocks;
  * state: KV pages `[P, BS, KVH, hd]` on the kv-head axis, conv state `[S, C, W-1]` on the (shard-major)
    channel axis, recurrent state `[S, H, K, V]` on the head axis.

N must divide every head count it splits (query and kv heads, linear key heads, Mamba2 heads and groups)
and the dense MLP intermediate sizes; `validate_tensor_parallel` raises a ValueError naming the counts
otherwise. The kv heads may instead divide N: each is then stored N / KVH times (`replicate_kv_heads`,
as vLLM does), so every device holds one.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jhybrid.cache.state import CacheConfig, HybridState, init_state
from jhybrid.config import ModelConfig
from jhybrid.models.quant import BLOCK, Fp8Weight
from jhybrid.parallel.layout import TP_AXIS, interleave, num_shards

_COL, _ROW, _VEC, _REP = P(None, TP_AXIS), P(TP_AXIS, None), P(TP_AXIS), P()
_EXPERT = P(TP_AXIS, None, None)

# mixer key -> {packed parameter: spec}; anything not listed is replicated
_MIXER_SPECS = {
    "attn": {"qkv_proj": _COL, "qkv_bias": _VEC, "o_proj": _ROW},
    "gdn": {"in_proj": _COL, "conv_weight": _ROW, "dt_bias": _VEC, "A_log": _VEC, "out_proj": _ROW},
    "lightning": {"in_proj": _COL, "norm": _VEC, "out_proj": _ROW},
    "mamba": {"in_proj": _COL, "in_proj_bias": _VEC, "conv_weight": _ROW, "conv_bias": _VEC, "dt_bias": _VEC,
              "A_log": _VEC, "D": _VEC, "norm": _VEC, "out_proj": _ROW},
}
_DENSE_SPECS = {"gate_up_proj": _COL, "gate_up_bias": _VEC, "up_proj": _COL, "up_bias": _VEC, "down_proj": _ROW}
_EXPERT_SPECS = {"gate_up_proj": _EXPERT, "up_proj": _EXPERT, "down_proj": _EXPERT}


def validate_tensor_parallel(cfg: ModelConfig, tensor_parallel_size: int) -> None:
    """Raises ValueError unless `tensor_parallel_size` divides every count it splits."""
    n = tensor_parallel_size
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {n!r}")
    counts: dict[str, int] = {}
    kinds = set(cfg.layer_kinds)
    if "full_attention" in kinds:
        counts |= {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads}
    if "lightning_attention" in kinds:
        counts["num_attention_heads"] = cfg.num_heads
    if "linear_attention" in kinds:
        counts |= {"linear_num_key_heads": cfg.linear_num_key_heads,
                   "linear_num_value_heads": cfg.linear_num_value_heads}
    if "mamba2" in kinds:
        counts |= {"mamba_num_heads": cfg.mamba_num_heads, "mamba_n_groups": cfg.mamba_n_groups}
    if "dense" in cfg.mlp_kinds:
        counts["intermediate_size"] = cfg.intermediate_size
    if "moe" in cfg.mlp_kinds and cfg.shared_expert_intermediate_size:
        counts["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    bad = {k: v for k, v in counts.items() if v % n}
    if "num_key_value_heads" in bad and n % counts["num_key_value_heads"] == 0:
        del bad["num_key_value_heads"]  # fewer kv heads than devices: each is copied (`replicate_kv_heads`)
    if bad:
        shown = ", ".join(f"{k}={v}" for k, v in counts.items())
        raise ValueError(
            f"tensor_parallel_size={n} must divide {', '.join(bad)} of this {cfg.model_type} model ({shown}); "
            f"choose a tensor_parallel_size that divides all of them (num_key_value_heads may instead divide it)"
        )


def kv_replication(cfg: ModelConfig, tensor_parallel_size: int) -> int:
    """How many copies of each kv head `tensor_parallel_size` devices need so that each holds whole ones:
    N / num_kv_heads when the model has fewer kv heads than devices, else 1."""
    kvh, n = cfg.num_kv_heads, tensor_parallel_size
    if "full_attention" not in cfg.layer_kinds or kvh >= n or n % kvh:
        return 1
    return n // kvh


def replicate_kv_heads(cfg: ModelConfig, params: dict, copies: int) -> tuple[ModelConfig, dict]:
    """The same model with each kv head stored `copies` times (heads `j*copies .. j*copies + copies - 1`
    are copies of head j), so that tensor parallelism over more devices than kv heads gives every device
    one, as vLLM does. Query head h reads kv head `h // (H / KVH')`, a copy of its original head, so the
    attention is unchanged; each device's KV pages hold its own copy. `params` are packed."""
    if copies == 1:
        return cfg, params
    kvh, hd = cfg.num_kv_heads, cfg.head_dim
    q_out = cfg.num_heads * hd * (2 if cfg.attn_output_gate else 1)

    def copied(w):  # [..., KVH*hd] -> [..., KVH*copies*hd]
        lead = w.shape[:-1]
        return jnp.repeat(w.reshape(*lead, kvh, hd), copies, axis=-2).reshape(*lead, kvh * copies * hd)

    layers = []
    for i, layer in enumerate(params["layers"]):
        if "attn" in layer:
            attn = dict(layer["attn"])
            for name in ("qkv_proj", "qkv_bias"):
                if isinstance(attn.get(name), Fp8Weight):
                    raise ValueError(f"layers.{i}.attn.{name} is an FP8 weight: its kv heads cannot be copied for "
                                     f"tensor parallelism over more devices than the {kvh} kv heads; quantize the "
                                     "model for this tensor_parallel_size (quantize_params(params, fp8_layout(cfg, N)) "
                                     "keeps it unquantized)")
                if name in attn:
                    w = attn[name]
                    q, k, v = w[..., :q_out], w[..., q_out:q_out + kvh * hd], w[..., q_out + kvh * hd:]
                    attn[name] = jnp.concatenate([q, copied(k), copied(v)], axis=-1)
            layer = {**layer, "attn": attn}
        layers.append(layer)
    return dataclasses.replace(cfg, num_kv_heads=kvh * copies), {**params, "layers": tuple(layers)}


# ----------------------------------------------------------------------------- the packed segments
def _segments(cfg: ModelConfig, key: str, name: str, size: int) -> tuple[tuple[int, ...], int] | None:
    """(segment sizes, axis) of a packed parameter whose shard-major layout differs from the single-device
    one; None for parameters split as they are. `size`: the parameter's packed-axis length (MLPs)."""
    if key == "attn" and name in ("qkv_proj", "qkv_bias"):
        kv = cfg.num_kv_heads * cfg.head_dim
        return (cfg.num_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1), kv, kv), -1
    if key == "gdn":
        qk, v, hv = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
        if name == "in_proj":
            return (qk, qk, v, v, hv, hv), -1  # q, k, v | z | b | a
        if name == "conv_weight":
            return (qk, qk, v), 0
    if key == "lightning" and name == "in_proj":
        hd = cfg.num_heads * cfg.head_dim
        return (3 * hd, hd), -1  # qkv (per head q, k, v) | output gate
    if key == "mamba":
        inner, gn, h = cfg.mamba_intermediate_size, cfg.mamba_n_groups * cfg.ssm_state_size, cfg.mamba_num_heads
        if name in ("in_proj", "in_proj_bias"):
            return (inner, inner, gn, gn, h), -1  # z | x, B, C | dt
        if name in ("conv_weight", "conv_bias"):
            return (inner, gn, gn), 0
    if key == "mlp" and name in ("gate_up_proj", "gate_up_bias"):
        return (size // 2, size // 2), -1  # gate | up
    return None


def _walk(cfg: ModelConfig, params: dict, n: int, leaf_fn) -> dict:
    """Maps `leaf_fn(value, spec, segments)` over the packed parameter pytree."""
    vocab_spec = lambda axis: P(*([None] * axis), TP_AXIS) if cfg.vocab_size % n == 0 else _REP  # noqa: E731
    out: dict[str, Any] = {}
    for name, value in params.items():
        if name == "embed":
            out[name] = leaf_fn(value, vocab_spec(0), None)
        elif name == "lm_head":
            out[name] = leaf_fn(value, vocab_spec(1), None)
        elif name == "layers":
            out[name] = tuple(_walk_layer(cfg, layer, n, leaf_fn) for layer in value)
        else:
            out[name] = leaf_fn(value, _REP, None)
    return out


def _walk_layer(cfg: ModelConfig, layer: dict, n: int, leaf_fn) -> dict:
    out: dict[str, Any] = {}
    for key, value in layer.items():
        if key in _MIXER_SPECS:
            specs = _MIXER_SPECS[key]
            out[key] = {k: leaf_fn(v, specs.get(k, _REP), _segments(cfg, key, k, v.shape[-1])) for k, v in value.items()}
        elif key == "mlp":
            out[key] = _walk_mlp(cfg, value, n, leaf_fn)
        else:
            out[key] = leaf_fn(value, _REP, None)
    return out


def _walk_mlp(cfg: ModelConfig, p: dict, n: int, leaf_fn) -> dict:
    experts = "router" in p
    out: dict[str, Any] = {}
    for k, v in p.items():
        if k == "shared":
            out[k] = {kk: leaf_fn(vv, _DENSE_SPECS.get(kk, _REP), _segments(cfg, "mlp", kk, vv.shape[-1]))
                      for kk, vv in v.items()}
        elif experts:  # routed experts: split along the expert axis, never permuted
            spec = _EXPERT_SPECS.get(k, _REP) if cfg.num_experts % n == 0 else _REP
            out[k] = leaf_fn(v, spec, None)
        else:
            out[k] = leaf_fn(v, _DENSE_SPECS.get(k, _REP), _segments(cfg, "mlp", k, v.shape[-1]))
    return out


def param_specs(cfg: ModelConfig, params: dict, tensor_parallel_size: int) -> dict:
    """A PartitionSpec for every leaf of the packed parameter pytree (an `Fp8Weight`'s values and scales: the
    spec of the weight they hold, its last two axes swapped)."""

    def leaf(value, spec, seg):
        if isinstance(value, Fp8Weight):
            return dataclasses.replace(value, w=_fp8_spec(spec, value.w.ndim), scale=_fp8_spec(spec, value.w.ndim))
        return spec

    return _walk(cfg, params, tensor_parallel_size, leaf)


def to_shard_major(cfg: ModelConfig, params: dict, tensor_parallel_size: int) -> dict:
    """The packed (single-device) parameters in the shard-major layout of `tensor_parallel_size` shards."""
    n = tensor_parallel_size

    def leaf(value, spec, seg):
        if isinstance(value, Fp8Weight):
            return _fp8_shard_major(value, spec, seg, n)
        return value if seg is None or n == 1 else interleave(value, seg[0], n, seg[1])

    return _walk(cfg, params, n, leaf)


def fp8_layout(cfg: ModelConfig, tensor_parallel_size: int):
    """What `jhybrid.models.quant.quantize_params` / `quantize_layer` take as `splittable` for a model `cfg` over
    `tensor_parallel_size` devices (`fp8_splittable` of each layer; None on one device: everything splits)."""
    if tensor_parallel_size == 1:
        return None
    return functools.partial(fp8_splittable, cfg, tensor_parallel_size=tensor_parallel_size)


def fp8_splittable(cfg: ModelConfig, layer: dict, tensor_parallel_size: int) -> dict:
    """For each leaf of one packed layer (a dict of the same structure, bools), whether its block-wise FP8 form
    splits `tensor_parallel_size` ways on whole 128-blocks: column-parallel, each packed segment's N-th (or the output
    dim's) a multiple of 128; row-parallel, the input dim's N-th; experts always (whole experts per device). The
    attention qkv projection is not when its kv heads are copied (`kv_replication` > 1: `replicate_kv_heads` works
    on unquantized weights)."""
    n = tensor_parallel_size

    def leaf(value, spec, seg):
        return _fp8_split_problem(value.shape, spec, seg, n) is None

    out = _walk_layer(cfg, layer, n, leaf)
    if "attn" in out and kv_replication(cfg, n) > 1:
        out["attn"] = {**out["attn"], "qkv_proj": False}
    return out


def _fp8_split_problem(shape: tuple[int, ...], spec: P, seg, n: int) -> str | None:
    """Why a `[..., K, N]` weight's FP8 blocks do not split as `spec` splits it over `n` devices (None: they do)."""
    if n == 1 or spec == _REP or spec == _EXPERT:
        return None
    if spec == _COL:
        sizes = seg[0] if seg is not None else (shape[-1],)
        if any(s % (BLOCK * n) for s in sizes):
            return f"output segments {tuple(sizes)} do not split {n} ways into whole {BLOCK}-blocks"
        return None
    if spec == _ROW:
        if shape[-2] % (BLOCK * n):
            return f"input dim {shape[-2]} does not split {n} ways into whole {BLOCK}-blocks"
        return None
    return f"a weight split as {spec} has no FP8 layout"


def _fp8_spec(spec: P, ndim: int) -> P:
    """The spec of an `Fp8Weight`'s `w [..., N, K]` (and scales) from that of the `[..., K, N]` weight it holds."""
    axes = tuple(spec) + (None,) * (ndim - len(spec))
    return P(*axes[:-2], axes[-1], axes[-2])


def _fp8_shard_major(value: Fp8Weight, spec: P, seg, n: int) -> Fp8Weight:
    """`value` with its packed segments' blocks (rows of `w`, of `scale`) in the shard-major order of `n` shards."""
    if problem := _fp8_split_problem(value.shape, spec, seg, n):
        raise ValueError(f"an FP8 weight of shape {value.shape} cannot be split over tensor_parallel_size={n}: "
                         f"{problem}; quantize the model for this size (quantize_params(params, fp8_layout(cfg, {n})) "
                         "leaves such projections in the load dtype) or use quantization='none'")
    if seg is None or n == 1:
        return value
    return dataclasses.replace(value, w=interleave(value.w, seg[0], n, -2),
                               scale=interleave(value.scale, [s // BLOCK for s in seg[0]], n, -2))


def _put(x, sharding: NamedSharding):
    """Places a host or single-device array with `sharding` (also across processes: every process passes
    the same value and contributes its own devices' blocks)."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(cfg: ModelConfig, params: dict, mesh: Mesh) -> dict:
    """Packed parameters -> shard-major layout, placed on `mesh` with their NamedShardings."""
    return shard_params_from(cfg, params, mesh, lambda value: value)


def shard_params_from(cfg: ModelConfig, leaves: dict, mesh: Mesh, make_leaf) -> dict:
    """Like `shard_params`, but builds each parameter as it goes: `leaves` is the packed pytree with any
    leaf objects that have a `.shape`, and `make_leaf(leaf)` returns that parameter's packed single-device
    value, which is re-laid out and split at once. So at most one whole parameter exists at a time, and a
    model that only fits split (Qwen3.5-35B-A3B's 69 GB on two GPUs) never needs a whole copy on one
    device (random weights in benchmarks; a checkpoint read one tensor at a time)."""
    n = num_shards(mesh)
    validate_tensor_parallel(cfg, n)

    def leaf(spec_leaf, spec, seg):
        value = make_leaf(spec_leaf)
        if isinstance(value, Fp8Weight):
            value = _fp8_shard_major(value, spec, seg, n)
            sharding = NamedSharding(mesh, _fp8_spec(spec, value.w.ndim))
            split = n > 1 and value.w.ndim == 2 and spec in (_COL, _ROW)  # `linear` then runs per shard
            return dataclasses.replace(value, w=_put(value.w, sharding), scale=_put(value.scale, sharding),
                                       mesh=mesh if split else None,
                                       split_axis=(0 if spec == _COL else 1) if split else None)
        value = value if seg is None or n == 1 else interleave(value, seg[0], n, seg[1])
        return _put(value, NamedSharding(mesh, spec))

    return _walk(cfg, leaves, n, leaf)


# ----------------------------------------------------------------------------- state
def state_specs(cfg: ModelConfig) -> HybridState:
    """PartitionSpecs of the state pytree (lightning attention's placeholder conv state is replicated)."""
    kv = P(None, None, TP_AXIS, None)
    kinds = cfg.linear_layer_kinds
    return HybridState(
        k_pages=(kv,) * cfg.num_full_layers,
        v_pages=(kv,) * cfg.num_full_layers,
        conv=tuple(_REP if kind == "lightning_attention" else P(None, TP_AXIS, None) for kind in kinds),
        ssm=(P(None, TP_AXIS, None, None),) * len(kinds),
    )


def state_shardings(cfg: ModelConfig, mesh: Mesh) -> HybridState:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_specs(cfg), is_leaf=lambda x: isinstance(x, P))


def init_sharded_state(cfg: ModelConfig, cache: CacheConfig, mesh: Mesh) -> HybridState:
    """Zeroed caches created directly in their shards (no device ever holds the whole pool)."""
    validate_tensor_parallel(cfg, num_shards(mesh))
    return _state_maker(cfg, cache, mesh)()


@functools.lru_cache(maxsize=8)
def _state_maker(cfg: ModelConfig, cache: CacheConfig, mesh: Mesh):
    """One compiled zero-state maker per (model, cache, mesh): a fresh `jax.jit` of a fresh lambda would
    recompile on every call, which once passed for a slow TP prefill in benchmarks.tp (benchmarks/RESULTS.md,
    tensor parallelism, session 4)."""
    return jax.jit(functools.partial(init_state, cfg, cache), out_shardings=state_shardings(cfg, mesh))


def replicated(x, mesh: Mesh):
    """Inside a jitted function: asks XLA to gather `x` onto every device (e.g. logits for sampling)."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, _REP))


def constrain_state(state: HybridState, cfg: ModelConfig, mesh: Mesh) -> HybridState:
    """Inside a jitted function: keeps the new state in the state's shardings."""
    return jax.lax.with_sharding_constraint(state, state_shardings(cfg, mesh))


def shard_fraction(x: jax.Array) -> float:
    """The share of `x`'s elements each device holds (1/N when fully split over N devices, 1 when
    replicated): for tests and reports."""
    shard = x.sharding.shard_shape(x.shape)
    return float(np.prod(shard) / max(np.prod(x.shape), 1)) if x.size else 1.0


__all__ = [
    "constrain_state",
    "fp8_layout",
    "fp8_splittable",
    "init_sharded_state",
    "kv_replication",
    "param_specs",
    "replicate_kv_heads",
    "replicated",
    "shard_fraction",
    "shard_params",
    "shard_params_from",
    "state_shardings",
    "state_specs",
    "to_shard_major",
    "validate_tensor_parallel",
]
