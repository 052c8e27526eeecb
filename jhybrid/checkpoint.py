"""Loading model parameters from an HF directory or a converted jhybrid directory.

    cfg, params = load_model("path")              # either format; params is the nested pytree
    info = inspect_checkpoint("path")             # validates shapes from metadata only, reads no data

An HF directory has `config.json` + `model.safetensors` (or a sharded `model.safetensors.index.json`).
A converted directory has `jhybrid.json`, `config.json` and an orbax `params/` (see converters.convert).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Literal

import numpy as np

from converters.convert import FORMAT, MARKER_FILE, PARAMS_DIR, VERSION
from converters.dtypes import checkpoint_dtype, param_dtype, resolve_dtype
from converters.load import by_layer, config_from_hf, load_hf_params, open_hf
from converters.orbax_io import read_metadata, restore_flat
from converters.plan import ConversionError, format_problems
from converters.safetensors_io import INDEX_FILE, SINGLE_FILE
from jhybrid.config import ModelConfig
from jhybrid.models.params import Params, flatten_shapes, param_shapes, unflatten


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What `inspect_checkpoint` learns without reading tensor data.

    Attributes:
      format: "hf" or "jhybrid" (converted).
      cfg: the model config (`cfg.dtype` is the checkpoint's dtype).
      shapes: `{flat jhybrid name: shape}`, in parameter order.
      dtypes: `{flat jhybrid name: stored dtype name}` (HF: the dtype of its on-disk source).
      quantization: an FP8 HF checkpoint's `{"weight_block_size": (b0, b1), "num_fp8_tensors": n}` (its
        weights are dequantized as they are read; `quantization` fp8 quantizes them again layer by layer); None
        otherwise.
    """

    path: str
    format: Literal["hf", "jhybrid"]
    cfg: ModelConfig
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    quantization: dict[str, Any] | None = None


def is_converted(path: str | os.PathLike) -> bool:
    """Whether `path` is a converted jhybrid checkpoint (has jhybrid.json)."""
    return os.path.isfile(os.path.join(os.fspath(path), MARKER_FILE))


def is_hf(path: str | os.PathLike) -> bool:
    path = os.fspath(path)
    has_weights = any(os.path.isfile(os.path.join(path, f)) for f in (SINGLE_FILE, INDEX_FILE))
    return os.path.isfile(os.path.join(path, "config.json")) and has_weights


def _detect(path: str) -> Literal["hf", "jhybrid"]:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    if is_converted(path):
        return "jhybrid"
    if is_hf(path):
        return "hf"
    raise FileNotFoundError(
        f"{path} is not a checkpoint: expected {MARKER_FILE} (a converted jhybrid checkpoint) or config.json "
        f"with {SINGLE_FILE} / {INDEX_FILE} (an HF checkpoint)"
    )


def _read_marker(path: str) -> dict[str, Any]:
    with open(os.path.join(path, MARKER_FILE)) as f:
        marker = json.load(f)
    if marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise ConversionError(
            f"{path}/{MARKER_FILE}: unsupported format {marker.get('format')!r} version {marker.get('version')!r}; "
            f"this jhybrid reads format {FORMAT!r} version {VERSION}"
        )
    return marker


def _converted_config(path: str) -> ModelConfig:
    marker = _read_marker(path)
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path}: converted checkpoint has no config.json")
    with open(config_path) as f:
        cfg = config_from_hf(json.load(f), path)
    return dataclasses.replace(cfg, dtype=resolve_dtype(marker.get("dtype", cfg.dtype)).name)


def _check_converted(path: str, cfg: ModelConfig, found: dict[str, tuple[tuple[int, ...], np.dtype]]) -> None:
    expected = flatten_shapes(param_shapes(cfg))
    problems = []
    for name, shape in expected.items():
        if name not in found:
            problems.append(f"missing parameter {name!r} (expected shape {shape})")
        elif found[name][0] != shape:
            problems.append(f"parameter {name!r} has the wrong shape: expected {shape}, found {found[name][0]}")
    problems += [
        f"unexpected parameter {name!r} with shape {found[name][0]}: the config's layout has no place for it"
        for name in sorted(set(found) - set(expected))
    ]
    if problems:
        raise ConversionError(format_problems(f"{path}: checkpoint does not match its config.json", problems), problems)


def inspect_checkpoint(path: str | os.PathLike) -> CheckpointInfo:
    """Validates a checkpoint from metadata alone (safetensors headers / orbax metadata).

    Raises:
      FileNotFoundError: not a checkpoint directory.
      ConversionError: unsupported config, or missing / unexpected / mis-shaped tensors.
    """
    path = os.path.abspath(os.fspath(path))
    if _detect(path) == "jhybrid":
        cfg = _converted_config(path)
        params_dir = os.path.join(path, PARAMS_DIR)
        if not os.path.isdir(params_dir):
            raise ConversionError(f"{path}: converted checkpoint has no {PARAMS_DIR}/ directory")
        found = read_metadata(params_dir)
        _check_converted(path, cfg, found)
        shapes = flatten_shapes(param_shapes(cfg))
        return CheckpointInfo(path, "jhybrid", cfg, shapes, {n: found[n][1].name for n in shapes})
    with open_hf(path) as src:
        shapes = flatten_shapes(param_shapes(src.cfg))
        dtypes = {n: "/".join(sorted(d.name for d in src.source_dtypes(n))) for n in shapes}
        cfg = dataclasses.replace(src.cfg, dtype=checkpoint_dtype(src.cfg.dtype).name)
        quant = src.fp8 and {"weight_block_size": src.fp8.block, "num_fp8_tensors": len(src.fp8.scales)}
        return CheckpointInfo(path, "hf", cfg, shapes, dtypes, quant)


def load_model(path: str | os.PathLike, dtype: Any = None, progress: bool = False,
               layer_fn: Callable[[ModelConfig, dict], dict] | None = None) -> tuple[ModelConfig, Params]:
    """Loads parameters from an HF or a converted directory.

    Args:
      path: checkpoint directory (format detected by `jhybrid.json`).
      dtype: cast to "float32" / "bfloat16" / "float16" (A_log and dt_bias stay float32); default the
        checkpoint's dtype (converted: as stored; HF: config.json's dtype).
      progress: show a progress bar (HF checkpoints).
      layer_fn: `layer_fn(cfg, layer)` replaces each layer's parameters (e.g. packs and quantizes them). An HF
        checkpoint hands each layer over as soon as it is read (`converters.load.load_hf_params`), so the whole
        model never exists as read; a converted one is restored whole first.

    Returns:
      (cfg, params): `cfg.dtype` names the params' dtype; params is the nested pytree of jax arrays.
    """
    path = os.path.abspath(os.fspath(path))
    if _detect(path) == "hf":
        return load_hf_params(path, dtype=dtype, progress=progress, layer_fn=layer_fn)
    info = inspect_checkpoint(path)
    found = read_metadata(os.path.join(path, PARAMS_DIR))
    flat = restore_flat(os.path.join(path, PARAMS_DIR), found)
    cfg = info.cfg
    if dtype is not None:
        np_dtype = resolve_dtype(dtype)
        flat = {n: a.astype(param_dtype(n, np_dtype)) for n, a in flat.items()}
        cfg = dataclasses.replace(cfg, dtype=np_dtype.name)
    if layer_fn is not None:
        return cfg, by_layer(iter(flat.items()), cfg, layer_fn)
    return cfg, unflatten(flat, cfg)
