"""What `jhybrid inspect --config-only` prints: a model's sizes from its `config.json` alone (no weights).

- parameters: total, and active per token (MoE: the routed experts count `num_experts_per_tok / num_experts`
  of their weights; everything else, embeddings and LM head included, counts whole);
- weight bytes in bf16 (A_log, dt_bias and router biases in fp32, as jhybrid keeps them) and in block-wise
  FP8 (`FP8_NOTE`: the layout of `quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}`);
- KV-cache bytes per token (bf16 pages) and linear-state bytes per sequence (fp32; per layer kind: conv and
  recurrent state);
- the config fields jhybrid ignores on purpose (`jhybrid.config.ignored_fields`);
- per tensor-parallel size (powers of two that `jhybrid.parallel.sharding.validate_tensor_parallel` accepts,
  the engine's own rule: it divides the head counts and dense intermediate sizes), the per-GPU weights (split
  as `param_specs` splits them), KV and state, and whether they fit one H200 with room for a useful KV pool
  (`fits`); the smallest size that fits, in bf16 and in FP8.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
from typing import Any

from jhybrid.config import ModelConfig, ignored_fields

H200_BYTES = 141 * 10**9  # nominal (NVIDIA's 141 GB); the device reports ~150.7e9, of which ~139 GiB is usable
MEMORY_FRACTION, ACTIVATION_RESERVE = 0.9, 0.1  # the engine's defaults (EngineConfig.gpu_memory_utilization, plan_cache)
POOL_SEQS, POOL_TOKENS = 64, 8192  # a useful pool: `jhybrid serve`'s default 64 sequences, 8,192 tokens each
MARGIN_NOTE = (
    f"fits: the KV pool the engine would plan from what the weights leave ((141 GB - weights) x "
    f"{MEMORY_FRACTION} x {1 - ACTIVATION_RESERVE:g}) holds {POOL_SEQS} sequences of {POOL_TOKENS:,} tokens of "
    f"KV plus {POOL_SEQS + 1} state slots"
)
BLOCK = 128
# canonical leaf names of linear weights (jhybrid.models.params); routers, gates, conv, norms are not
_LINEAR = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                     "out_proj", "qkv_proj", "output_gate", "in_proj", "gate_proj", "up_proj", "down_proj"})
_FP32 = ("A_log", "dt_bias", "router_bias")
FP8_NOTE = (
    "FP8: linear weights in e4m3 with one fp32 scale per 128x128 block; embeddings, LM head, routers, "
    "shared-expert gates, conv and norms, and projections narrower than a block (e.g. GDN in_proj_b/a) in bf16 "
    "(the published checkpoints' layout, which these figures follow; jhybrid's --quantization fp8 holds every dense "
    "projection and routed expert whose input dim is a multiple of 128 in FP8, the packed GDN in_proj with its b/a "
    "columns too, and under tensor parallelism keeps a projection whose split is not on whole 128-blocks in bf16)"
)
_MAX_TP = 64


def _is_fp8(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a canonical parameter is stored in FP8 in the estimate (see FP8_NOTE)."""
    return name.startswith("layers.") and name.rsplit(".", 1)[-1] in _LINEAR and min(shape[-2:]) >= BLOCK


def tensor_bytes(name: str, shape: tuple[int, ...], fp8: bool) -> int:
    """Bytes of one parameter in bf16 (fp32 for `_FP32`), or in FP8 with its block scales."""
    n = math.prod(shape)
    if name.rsplit(".", 1)[-1] in _FP32:
        return 4 * n
    if fp8 and _is_fp8(name, shape):
        *lead, d_in, d_out = shape
        return n + 4 * math.prod(lead) * -(-d_in // BLOCK) * -(-d_out // BLOCK)
    return 2 * n


def _packed_names(flat: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """`{canonical name: packed name}` (`jhybrid.models.params.pack_params` concatenates, e.g. q/k/v_proj into
    qkv_proj, only when every part exists)."""
    from jhybrid.models.params import _PACKS

    out = {}
    for name in flat:
        parent, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        key = parent.rsplit(".", 1)[-1]
        packed = leaf
        for fused, parts in _PACKS.get("mlp" if key == "shared" else key, ()):
            if leaf in parts and all(f"{parent}.{p}" in flat for p in parts):
                packed = fused
        out[name] = f"{parent}.{packed}" if parent else packed
    return out


def _split_leaves(cfg: ModelConfig, flat: dict[str, tuple[int, ...]], n: int) -> set[str]:
    """Canonical names of the parameters `n`-way tensor parallelism splits (the rest is replicated)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    from jhybrid.models.params import flatten_params, pack_params, unflatten
    from jhybrid.parallel.layout import TP_AXIS
    from jhybrid.parallel.sharding import param_specs

    abstract = unflatten({k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in flat.items()}, cfg)
    packed = jax.eval_shape(pack_params, abstract)
    specs = param_specs(cfg, packed, n)
    marks = jax.tree.map(lambda spec: TP_AXIS in spec, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    split = {k for k, v in flatten_params(marks).items() if v}
    return {name for name, packed_name in _packed_names(flat).items() if packed_name in split}


@dataclasses.dataclass(frozen=True)
class TPRow:
    size: int
    weight_bytes_bf16: int  # per GPU
    weight_bytes_fp8: int
    kv_bytes_per_token: int  # per GPU, bf16
    state_bytes_per_sequence: int  # per GPU, fp32
    pool_bytes: int  # per GPU: POOL_SEQS x POOL_TOKENS tokens of KV + POOL_SEQS + 1 state slots
    fits_bf16: bool
    fits_fp8: bool


@dataclasses.dataclass(frozen=True)
class ConfigSummary:
    path: str
    cfg: ModelConfig
    num_params: int
    num_active_params: int
    weight_bytes_bf16: int
    weight_bytes_fp8: int
    kv_bytes_per_token: int  # bf16
    state_bytes_per_sequence: int  # fp32
    state_by_kind: dict[str, dict[str, int]]  # kind -> {layers, conv_bytes, recurrent_bytes} per sequence (all layers)
    ignored: dict[str, str]
    quantization: dict[str, Any] | None
    tp: list[TPRow]

    def smallest_tp(self, fp8: bool) -> int | None:
        return next((r.size for r in self.tp if (r.fits_fp8 if fp8 else r.fits_bf16)), None)

    def to_json(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "path": self.path, "model_type": cfg.model_type, "num_layers": cfg.num_layers,
            "layer_kinds": dict(collections.Counter(cfg.layer_kinds)), "mlp_kinds": dict(collections.Counter(cfg.mlp_kinds)),
            "num_params": self.num_params, "num_active_params": self.num_active_params,
            "weight_bytes": {"bfloat16": self.weight_bytes_bf16, "fp8": self.weight_bytes_fp8},
            "kv_bytes_per_token": self.kv_bytes_per_token, "state_bytes_per_sequence": self.state_bytes_per_sequence,
            "state_by_kind": self.state_by_kind, "ignored_fields": self.ignored, "quantization_config": self.quantization,
            "tensor_parallel": [dataclasses.asdict(r) for r in self.tp],
            "smallest_tensor_parallel_size": {"bfloat16": self.smallest_tp(False), "fp8": self.smallest_tp(True)},
            "gpu": {"name": "H200", "bytes": H200_BYTES}, "margin": MARGIN_NOTE, "fp8_layout": FP8_NOTE,
        }

    def format(self) -> str:
        cfg, gb = self.cfg, lambda b: f"{b / 1e9:,.1f} GB"
        kinds = ", ".join(f"{n} {k}" for k, n in collections.Counter(cfg.layer_kinds).items())
        moe = sum(k == "moe" for k in cfg.mlp_kinds)
        lines = [
            f"config: {self.path}",
            f"model_type: {cfg.model_type}   layers: {cfg.num_layers} ({kinds})"
            + (f"   MoE layers: {moe} ({cfg.num_experts} experts, top-{cfg.num_experts_per_tok})" if moe else ""),
            f"parameters: {self.num_params:,} ({self.num_params / 1e9:.2f} B)"
            + (f"; active per token: {self.num_active_params:,} ({self.num_active_params / 1e9:.2f} B)" if moe else ""),
            f"weights: bf16 {gb(self.weight_bytes_bf16)}, FP8 {gb(self.weight_bytes_fp8)}  ({FP8_NOTE})",
            f"KV cache: {self.kv_bytes_per_token:,} bytes per token (bf16; {cfg.num_full_layers} full layers x 2 x "
            f"{cfg.num_kv_heads} kv heads x {cfg.head_dim})",
            f"linear state: {self.state_bytes_per_sequence:,} bytes per sequence (fp32)",
        ]
        for kind, s in self.state_by_kind.items():
            lines.append(f"  {kind}: {s['layers']} layers, conv {s['conv_bytes']:,} + recurrent {s['recurrent_bytes']:,} bytes")
        if self.quantization:
            lines.append(f"quantization_config: {json.dumps(self.quantization)} (dequantized at load)")
        lines.append("ignored on purpose: " + ("none" if not self.ignored else ""))
        lines += [f"  {k}: {why}" for k, why in self.ignored.items()]
        lines += ["", f"per GPU (H200, {gb(H200_BYTES)}) by tensor-parallel size; {MARGIN_NOTE}:",
                  f"{'TP':>4} {'bf16 weights':>14} {'FP8 weights':>14} {'KV/token':>10} {'state/seq':>12} "
                  f"{'pool':>10}  fits bf16 / FP8"]
        for r in self.tp:
            lines.append(f"{r.size:>4} {gb(r.weight_bytes_bf16):>14} {gb(r.weight_bytes_fp8):>14} {r.kv_bytes_per_token:>10,} "
                         f"{r.state_bytes_per_sequence:>12,} {gb(r.pool_bytes):>10}  "
                         f"{'yes' if r.fits_bf16 else 'no'} / {'yes' if r.fits_fp8 else 'no'}")
        def shown(n: int | None) -> str:
            return f"none up to {_MAX_TP}" if n is None else str(n) + (" (more than one 8-GPU node)" if n > 8 else "")

        lines.append(f"smallest tensor-parallel size: bf16 {shown(self.smallest_tp(False))}, "
                     f"FP8 {shown(self.smallest_tp(True))}")
        return "\n".join(lines)


def read_config(path: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """(the config file's path, its dict) from a config.json or a directory holding one."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json at {path}")
    with open(path) as f:
        try:
            return path, json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None


def summarize_config(path: str | os.PathLike) -> ConfigSummary:
    """Sizes of the model `path` (a config.json or a directory) describes; reads no weights.

    Raises:
      FileNotFoundError: no config.json.
      ValueError: a config jhybrid cannot build (named fields, see `ModelConfig.from_hf`).
    """
    from jhybrid.config_fields import read_quantization_config
    from jhybrid.models.params import flatten_shapes, param_shapes
    from jhybrid.parallel.sharding import kv_replication, validate_tensor_parallel

    path, hf = read_config(path)
    cfg = ModelConfig.from_hf(hf)
    ignored = ignored_fields(hf)
    flat = flatten_shapes(param_shapes(cfg))
    total = sum(math.prod(s) for s in flat.values())
    active = 0
    for name, shape in flat.items():
        n = math.prod(shape)
        layer = int(name.split(".")[1]) if name.startswith("layers.") else -1
        routed = layer >= 0 and cfg.mlp_kinds[layer] == "moe" and ".mlp." in name and len(shape) == 3
        active += n * cfg.num_experts_per_tok // cfg.num_experts if routed else n
    by_kind: dict[str, dict[str, int]] = {}
    for kind in cfg.linear_layer_kinds:
        (c, w1), (h, k, v) = cfg.linear_state_shapes(kind)
        s = by_kind.setdefault(kind, {"layers": 0, "conv_bytes": 0, "recurrent_bytes": 0})
        s["layers"] += 1
        s["conv_bytes"] += 4 * c * w1
        s["recurrent_bytes"] += 4 * h * k * v
    kv, state = cfg.kv_bytes_per_token(2), cfg.state_bytes_per_sequence()
    rows = []
    size = 1
    while size <= _MAX_TP:
        try:
            validate_tensor_parallel(cfg, size)
        except ValueError:
            size *= 2
            continue
        split = _split_leaves(cfg, flat, size) if size > 1 else set()
        per_gpu = lambda fp8: sum(tensor_bytes(n, s, fp8) // (size if n in split else 1) for n, s in flat.items())  # noqa: E731
        kv_gpu = cfg.num_full_layers * 2 * cfg.num_kv_heads * kv_replication(cfg, size) // size * cfg.head_dim * 2
        state_gpu = state // size
        pool = POOL_SEQS * POOL_TOKENS * kv_gpu + (POOL_SEQS + 1) * state_gpu
        w16, w8 = per_gpu(False), per_gpu(True)
        fits = lambda w: (H200_BYTES - w) * MEMORY_FRACTION * (1 - ACTIVATION_RESERVE) >= pool  # noqa: E731
        rows.append(TPRow(size, w16, w8, kv_gpu, state_gpu, pool, fits(w16), fits(w8)))
        if fits(w16) and fits(w8) and size >= 8:
            break
        size *= 2
    return ConfigSummary(
        path=path, cfg=cfg, num_params=total, num_active_params=active,
        weight_bytes_bf16=sum(tensor_bytes(n, s, False) for n, s in flat.items()),
        weight_bytes_fp8=sum(tensor_bytes(n, s, True) for n, s in flat.items()),
        kv_bytes_per_token=kv, state_bytes_per_sequence=state, state_by_kind=by_kind, ignored=ignored,
        quantization=read_quantization_config(hf), tp=rows,
    )
