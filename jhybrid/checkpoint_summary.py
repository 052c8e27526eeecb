"""What `jhybrid inspect` prints: a checkpoint's layout, sizes and memory plan, from metadata only."""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Any

import numpy as np

from converters.dtypes import resolve_dtype
from jhybrid.checkpoint import CheckpointInfo, inspect_checkpoint
from jhybrid.config import LINEAR_KINDS


@dataclasses.dataclass(frozen=True)
class LayerSummary:
    index: int
    kind: str  # `jhybrid.config.LAYER_KINDS`: full_attention, linear_attention (GDN), lightning_attention, mamba2, none
    mlp: str  # "dense" | "moe" | "none"
    num_params: int
    state: str = ""  # linear layers: per-slot state shapes, e.g. "conv 64x3 + ssm 4x8x8"
    state_bytes: int = 0  # fp32 bytes of that state per sequence


@dataclasses.dataclass(frozen=True)
class Summary:
    info: CheckpointInfo
    layers: list[LayerSummary]
    other_params: dict[str, int]  # embed, final_norm, lm_head
    dtype_counts: dict[str, int]  # stored dtype -> number of tensors
    kv_bytes_per_token: int
    state_bytes_per_sequence: int

    @property
    def num_params(self) -> int:
        return sum(layer.num_params for layer in self.layers) + sum(self.other_params.values())

    def to_json(self) -> dict[str, Any]:
        cfg = self.info.cfg
        return {
            "path": self.info.path,
            "format": self.info.format,
            "model_type": cfg.model_type,
            "dtype": cfg.dtype,
            "layers": [dataclasses.asdict(layer) for layer in self.layers],
            "other_params": self.other_params,
            "num_params": self.num_params,
            "tensor_dtypes": self.dtype_counts,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "state_bytes_per_sequence": self.state_bytes_per_sequence,
            "quantization": self.info.quantization,
            "fp8_at_load": fp8_at_load(self.info) if self.info.quantization else None,
        }

    def format(self) -> str:
        cfg = self.info.cfg
        kinds = collections.Counter(cfg.layer_kinds)
        fmt = "HF safetensors" if self.info.format == "hf" else "jhybrid (converted)"
        lines = [
            f"checkpoint: {self.info.path}  [{fmt}]",
            f"model_type: {cfg.model_type}   dtype: {cfg.dtype}   layers: {cfg.num_layers} "
            f"({', '.join(f'{n} {kind}' for kind, n in kinds.items())})",
            "",
            f"{'layer':>5}  {'kind':<20} {'mlp':<6} {'params':>14}  state per sequence (fp32)",
        ]
        for layer in self.layers:
            state = f"  {layer.state} = {layer.state_bytes:,} bytes" if layer.state else ""
            lines.append(f"{layer.index:>5}  {layer.kind:<20} {layer.mlp:<6} {layer.num_params:>14,}{state}")
        for name, n in self.other_params.items():
            lines.append(f"{'':>5}  {name:<27} {n:>14,}")
        dtypes = ", ".join(f"{d} ({n} tensors)" for d, n in self.dtype_counts.items())
        kv_itemsize = resolve_dtype(cfg.dtype).itemsize
        lines += [
            f"{'':>5}  {'total':<27} {self.num_params:>14,}",
            "",
            f"tensor dtypes: {dtypes}",
            f"KV cache: {self.kv_bytes_per_token:,} bytes per token "
            f"({cfg.num_full_layers} full layers x 2 x {cfg.num_kv_heads} kv heads x {cfg.head_dim} x {kv_itemsize} bytes)",
            f"linear state: {self.state_bytes_per_sequence:,} bytes per sequence "
            f"({cfg.num_linear_layers} linear layers: "
            f"{', '.join(f'{n} {k}' for k, n in collections.Counter(cfg.linear_layer_kinds).items()) or 'none'}; "
            "conv + recurrent state in float32)",
        ]
        if q := self.info.quantization:
            b0, b1 = q["weight_block_size"]
            fp8 = fp8_at_load(self.info)
            lines.append(f"FP8 weights: {q['num_fp8_tensors']} tensors in float8_e4m3fn with a scale per {b0}x{b1} "
                         f"block (quantization_config); with quantization fp8 (auto: on a GPU with FP8 tensor cores) "
                         f"held at run time in 128x128 blocks: {fp8['projections']} projections and "
                         f"{fp8['expert_tensors']} routed-expert tensors, {fp8['left']} left in the compute dtype "
                         f"(input dim not a multiple of 128); otherwise dequantized at load to the compute dtype")
        if scalings := _scalings(cfg):
            lines.append(f"scalings: {scalings}")
        lines.append("checkpoint OK")
        return "\n".join(lines)


def summarize(path: str | os.PathLike) -> Summary:
    """Validates `path` (see `jhybrid.checkpoint.inspect_checkpoint`) and summarises it."""
    info = inspect_checkpoint(path)
    cfg = info.cfg
    per_layer = collections.Counter()
    other: dict[str, int] = {}
    for name, shape in info.shapes.items():
        n = int(np.prod(shape, dtype=np.int64))
        if name.startswith("layers."):
            per_layer[int(name.split(".")[1])] += n
        else:
            other[name] = other.get(name, 0) + n
    layers = [
        LayerSummary(i, cfg.layer_kinds[i], cfg.mlp_kinds[i], per_layer[i], *_layer_state(cfg, cfg.layer_kinds[i]))
        for i in range(cfg.num_layers)
    ]
    return Summary(
        info=info,
        layers=layers,
        other_params=other,
        dtype_counts=dict(collections.Counter(info.dtypes.values()).most_common()),
        kv_bytes_per_token=cfg.kv_bytes_per_token(resolve_dtype(cfg.dtype).itemsize),
        state_bytes_per_sequence=cfg.state_bytes_per_sequence(),
    )


def fp8_at_load(info: CheckpointInfo) -> dict[str, int]:
    """What `quantization="fp8"` makes of the checkpoint's weights on one device (`jhybrid.models.quant`, from the
    shapes alone): `{"projections", "expert_tensors"}` held in FP8 (packed projections; routed-expert stacks) and
    `"left"`: the candidates kept in the compute dtype, their input dim not a multiple of 128."""
    import jax
    import jax.numpy as jnp

    from jhybrid.models.params import pack_params, unflatten
    from jhybrid.models.quant import BLOCK, candidates

    abstract = unflatten({k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in info.shapes.items()}, info.cfg)
    found = [(kind, w.shape[-2] % BLOCK == 0) for layer in jax.eval_shape(pack_params, abstract)["layers"]
             for kind, _, w in candidates(layer)]
    return {"projections": sum(ok and kind != "experts" for kind, ok in found),
            "expert_tensors": sum(ok and kind == "experts" for kind, ok in found),
            "left": sum(not ok for _, ok in found)}


def _scalings(cfg) -> str:
    """Granite's non-neutral multipliers, e.g. "embeddings x12, attention scale 0.015, residual x0.22,
    logits /6" ("" when every one is neutral, as in the other families)."""
    parts = []
    if cfg.embedding_multiplier != 1.0:
        parts.append(f"embeddings x{cfg.embedding_multiplier:g}")
    if cfg.attention_scale is not None:
        parts.append(f"attention scale {cfg.attention_scale:g}")
    betas = {cfg.full_attn_beta, cfg.linear_attn_beta, cfg.mlp_beta}
    if len(betas) == 1 and betas != {1.0} and not cfg.residual_from_norm and cfg.mlp_alpha == 1.0:
        parts.append(f"residual x{cfg.mlp_beta:g}")
    if cfg.logits_scaling != 1.0:
        parts.append(f"logits /{cfg.logits_scaling:g}")
    return ", ".join(parts)


def _layer_state(cfg, kind: str) -> tuple[str, int]:
    """("conv C x W-1 + ssm H x K x V", fp32 bytes per sequence) of a linear layer; ("", 0) otherwise."""
    if kind not in LINEAR_KINDS:
        return "", 0
    conv, ssm = cfg.linear_state_shapes(kind)
    text = "x".join(map(str, ssm))
    text = f"conv {'x'.join(map(str, conv))} + ssm {text}" if conv[0] else f"ssm {text} (no conv)"
    return text, 4 * (conv[0] * conv[1] + int(np.prod(ssm)))
