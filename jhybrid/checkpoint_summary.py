"""What `jhybrid inspect` prints: a checkpoint's layout, sizes and memory plan, from metadata only."""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Any

import numpy as np

from converters.dtypes import resolve_dtype
from jhybrid.checkpoint import CheckpointInfo, inspect_checkpoint


@dataclasses.dataclass(frozen=True)
class LayerSummary:
    index: int
    kind: str  # "full_attention" | "linear_attention"
    mlp: str  # "dense" | "moe"
    num_params: int


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
        }

    def format(self) -> str:
        cfg = self.info.cfg
        kinds = collections.Counter(cfg.layer_kinds)
        fmt = "HF safetensors" if self.info.format == "hf" else "jhybrid (converted)"
        lines = [
            f"checkpoint: {self.info.path}  [{fmt}]",
            f"model_type: {cfg.model_type}   dtype: {cfg.dtype}   layers: {cfg.num_layers} "
            f"({kinds['linear_attention']} linear_attention, {kinds['full_attention']} full_attention)",
            "",
            f"{'layer':>5}  {'kind':<17} {'mlp':<6} {'params':>14}",
        ]
        for layer in self.layers:
            lines.append(f"{layer.index:>5}  {layer.kind:<17} {layer.mlp:<6} {layer.num_params:>14,}")
        for name, n in self.other_params.items():
            lines.append(f"{'':>5}  {name:<24} {n:>14,}")
        dtypes = ", ".join(f"{d} ({n} tensors)" for d, n in self.dtype_counts.items())
        kv_itemsize = resolve_dtype(cfg.dtype).itemsize
        lines += [
            f"{'':>5}  {'total':<24} {self.num_params:>14,}",
            "",
            f"tensor dtypes: {dtypes}",
            f"KV cache: {self.kv_bytes_per_token:,} bytes per token "
            f"({cfg.num_full_layers} full layers x 2 x {cfg.num_kv_heads} kv heads x {cfg.head_dim} x {kv_itemsize} bytes)",
            f"linear state: {self.state_bytes_per_sequence:,} bytes per sequence "
            f"({cfg.num_linear_layers} linear layers, conv + recurrent state in float32)",
            "checkpoint OK",
        ]
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
    layers = [LayerSummary(i, cfg.layer_kinds[i], cfg.mlp_kinds[i], per_layer[i]) for i in range(cfg.num_layers)]
    return Summary(
        info=info,
        layers=layers,
        other_params=other,
        dtype_counts=dict(collections.Counter(info.dtypes.values()).most_common()),
        kv_bytes_per_token=cfg.kv_bytes_per_token(resolve_dtype(cfg.dtype).itemsize),
        state_bytes_per_sequence=cfg.state_bytes_per_sequence(),
    )
