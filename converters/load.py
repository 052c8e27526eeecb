"""HF checkpoint directory -> jhybrid parameters (validated, converted, cast)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Callable, Iterator

import numpy as np

from converters.dtypes import checkpoint_dtype, param_dtype, resolve_dtype
from converters.fp8 import FP8Weights, pair_scales
from converters.name_maps import build_plan, ignored_group, is_ignored, normalize_name
from converters.plan import ConversionError, Plan, apply_rule, check_plan
from converters.safetensors_io import SafetensorsCheckpoint
from jhybrid.config import ModelConfig
from jhybrid.config_fields import read_quantization_config
from jhybrid.models.params import Params, flatten_shapes, param_shapes, unflatten, unflatten_shapes

log = logging.getLogger("jhybrid.convert")


def config_from_hf(hf_config: dict[str, Any], where: str) -> ModelConfig:
    """`ModelConfig.from_hf`, with errors (e.g. an unsupported model_type) raised as ConversionError."""
    try:
        return ModelConfig.from_hf(hf_config)
    except (ValueError, KeyError, TypeError) as e:
        msg = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        raise ConversionError(f"{where}/config.json: {msg}") from None


def _disk_names(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, consumed: set[str] = frozenset()) -> dict[str, str]:
    """`{normalised name: on-disk name}` of the tensors that are not ignored; the ignored ones are logged
    (once per checkpoint and group: a vision tower, multi-token-prediction heads, ...). `consumed`: on-disk
    tensors read with another one (FP8 scales), left out."""
    out: dict[str, str] = {}
    ignored: dict[str, int] = {}
    for raw in ckpt.names():
        if raw in consumed:
            continue
        name = normalize_name(raw)
        if is_ignored(name, cfg):
            group = ignored_group(name)
            ignored[group] = ignored.get(group, 0) + 1
            continue
        if name in out:
            raise ConversionError(f"{ckpt.path}: tensors {out[name]!r} and {raw!r} both map to {name!r}")
        out[name] = raw
    if ignored:
        _log_ignored_tensors(ckpt.path, tuple(sorted(ignored.items())))
    return out


@functools.lru_cache(maxsize=64)  # once per checkpoint: it is opened again by each loader
def _log_ignored_tensors(path: str, groups: tuple[tuple[str, int], ...]) -> None:
    log.info("%s: not loading %s", path, "; ".join(f"{n} tensor(s) {g}" for g, n in groups))


@dataclasses.dataclass
class HFSource:
    """An opened, validated HF checkpoint: its config, plan, and the on-disk name of each source."""

    ckpt: SafetensorsCheckpoint
    cfg: ModelConfig
    plan: Plan
    raw_names: dict[str, str]  # normalised -> on-disk name
    fp8: FP8Weights | None = None  # block-wise FP8 weights and their scales (converters/fp8.py), dequantized on read

    def source_dtypes(self, jname: str) -> set[np.dtype]:
        return {self.ckpt.dtype(self.raw_names[s]) for s in self.plan[jname].sources}

    def iter_params(self, dtype: np.dtype | None) -> Iterator[tuple[str, np.ndarray]]:
        """Yields `(flat jhybrid name, numpy array)`, cast per `converters.dtypes.param_dtype` (or kept
        in the on-disk dtype when `dtype` is None; float32 for FP8 weights, dequantized)."""
        for jname, out, target in self._converted(dtype):
            yield jname, np.array(out, dtype=target, copy=True, order="C")  # owns its memory (not the mmap)

    def iter_device_params(self, dtype: np.dtype | None) -> Iterator[tuple[str, Any]]:
        """As `iter_params`, as JAX arrays on the default device. A weight that is a transpose of the bytes on
        disk (HF's [out, in] linear weights) goes to the device as stored and is transposed there: transposing
        on the host is a strided copy, and it was most of the loading time (~8 s of ~9 for a 3.2 GB model).
        FP8 weights go as stored too, and are dequantized and converted there."""
        import jax.numpy as jnp

        for jname, out, target in self._converted(dtype, device=True):
            if not isinstance(out, np.ndarray):  # built on the device from FP8 weights dequantized (and cast) there
                yield jname, out
            elif out.ndim >= 2 and not out.flags.c_contiguous and out.T.flags.c_contiguous:
                yield jname, jnp.asarray(np.asarray(out.T, dtype=target)).T
            else:
                yield jname, jnp.asarray(np.array(out, dtype=target, copy=True, order="C"))

    def _converted(self, dtype: np.dtype | None, device: bool = False) -> Iterator[tuple[str, Any, np.dtype]]:
        """`(name, converted view of the mapped file, target dtype)` per parameter. A parameter built from FP8
        weights is dequantized on the host, or with `device` on the default device (then a JAX array, already in
        the target dtype: its float32 products and the rule's inputs are not kept while the consumer works)."""
        expected = flatten_shapes(param_shapes(self.cfg))
        for jname, rule in self.plan.items():
            raw = [self.raw_names[s] for s in rule.sources]
            if self.fp8 is None or not any(r in self.fp8.scales for r in raw):
                arrays = [self.ckpt.read(r) for r in raw]
            elif device:
                arrays = [self.fp8.read_device(self.ckpt, r) for r in raw]
            else:
                arrays = [self.fp8.read(self.ckpt, r) for r in raw]
            out = apply_rule(jname, rule, arrays, expected[jname])
            del arrays
            target = out.dtype if dtype is None else param_dtype(jname, dtype)
            if not isinstance(out, np.ndarray):
                out = out.astype(target)
            yield jname, out, target

    def close(self) -> None:
        self.ckpt.close()

    def __enter__(self) -> "HFSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_hf(hf_dir: str | os.PathLike, cfg: ModelConfig | None = None) -> HFSource:
    """Opens an HF directory and validates its tensors against the config, reading headers only.

    A block-wise FP8 checkpoint (`quantization_config.quant_method: fp8`) is validated too (converters/fp8.py):
    its weights are dequantized as they are read, and its scales are consumed by them.

    Raises:
      FileNotFoundError: no config.json, or no safetensors files.
      ConversionError: unsupported config or quantization_config, missing / unexpected / mis-shaped tensors,
        or FP8 tensors that do not match the quantization_config.
    """
    ckpt = SafetensorsCheckpoint(hf_dir)
    try:
        cfg = cfg or config_from_hf(ckpt.config, ckpt.path)
        try:
            fp8 = pair_scales(ckpt, read_quantization_config(ckpt.config))
        except ConversionError:
            raise
        except ValueError as e:
            raise ConversionError(f"{ckpt.path}/config.json: {e}") from None
        raw_names = _disk_names(ckpt, cfg, consumed=set(fp8.scales.values()) if fp8 else set())
        plan = build_plan(cfg, raw_names)
        check_plan(plan, {n: ckpt.shape(raw) for n, raw in raw_names.items()}, ckpt.path)
    except BaseException:
        ckpt.close()
        raise
    return HFSource(ckpt, cfg, plan, raw_names, fp8)


def load_hf_params(
    hf_dir: str | os.PathLike, cfg: ModelConfig | None = None, dtype: Any = None, progress: bool = False,
    layer_fn: Callable[[ModelConfig, dict], dict] | None = None,
) -> tuple[ModelConfig, Params]:
    """Loads and converts an HF checkpoint.

    Args:
      hf_dir: directory with config.json and model.safetensors (or a sharded index).
      cfg: overrides the config read from config.json.
      dtype: "float32" / "bfloat16" / "float16" (or a dtype object); default the checkpoint's
        config dtype (float32 when absent). A_log and dt_bias stay float32 (see converters.dtypes).
      progress: show a tqdm bar over parameters.
      layer_fn: `layer_fn(cfg, layer)` is called with each layer's parameters as soon as all of them are read,
        and its result (waited for) replaces the layer, e.g. the layer packed and quantized to FP8: the layer's
        tensors as read are then freed before the next layer's are read, so the device peak is the transformed
        model plus about one layer as read.

    Returns:
      (cfg, params): `cfg.dtype` is the dtype the params were cast to; params is the nested pytree of
      `jhybrid.models.params` holding `jnp` arrays (its layers as `layer_fn` returns them).
    """
    import jax
    from tqdm import tqdm

    with open_hf(hf_dir, cfg) as src:
        np_dtype = resolve_dtype(dtype) if dtype is not None else checkpoint_dtype(src.cfg.dtype)
        cfg = dataclasses.replace(src.cfg, dtype=np_dtype.name)
        items = tqdm(src.iter_device_params(np_dtype), total=len(src.plan), desc="loading", unit="tensor",
                     disable=not progress)
        if layer_fn is None:
            flat = jax.block_until_ready(dict(items))  # before the file is unmapped: a transpose may still read it
            return cfg, unflatten(flat, cfg)
        return cfg, jax.block_until_ready(by_layer(items, cfg, layer_fn))


def by_layer(items: Iterator[tuple[str, Any]], cfg: ModelConfig,
             layer_fn: Callable[[ModelConfig, dict], dict]) -> Params:
    """The parameter pytree from `(flat name, array)` pairs, each layer handed to `layer_fn(cfg, layer)` once its
    last tensor arrives and replaced by the result (waited for, so the layer's own arrays can be freed first)."""
    import jax

    shapes = param_shapes(cfg)
    remaining = [len(flatten_shapes(layer)) for layer in shapes["layers"]]
    flat: dict[str, Any] = {}
    layers: list[Any] = [{} if not n else None for n in remaining]
    for name, value in items:
        flat[name] = value
        if not name.startswith("layers."):
            continue
        i = int(name.split(".", 2)[1])
        remaining[i] -= 1
        if remaining[i] == 0:
            prefix = f"layers.{i}."
            own = {k.removeprefix(prefix): flat.pop(k) for k in [k for k in flat if k.startswith(prefix)]}
            layers[i] = jax.block_until_ready(layer_fn(cfg, unflatten_shapes(own, shapes["layers"][i])))
            del own
    missing = [i for i, layer in enumerate(layers) if layer is None]
    if missing:  # only reachable through a bug in a name map (the plan covers every parameter)
        raise ConversionError(f"layers {missing} were not read completely")
    return {**unflatten_shapes(flat, {k: v for k, v in shapes.items() if k != "layers"}), "layers": tuple(layers)}
