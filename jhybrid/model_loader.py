"""`load(model, dtype)`: a checkpoint directory (HF or converted) -> a `LoadedModel`, what the engine runs:
the config, the parameters packed for the model, the tokenizer, every EOS id (config.json and
generation_config.json) and the checkpoint's sampling defaults (generation_config.json's temperature, top_k,
top_p, min_p, repetition_penalty and max_new_tokens, as vLLM's `--generation-config auto` reads them).

The checkpoint readers (`jhybrid.checkpoint`, over `converters`) are imported when a directory is loaded, not
with this module: `converters` imports `jhybrid.config`, which runs `jhybrid/__init__.py` and so the engine,
which imports this module; at the top here, `import converters` before `import jhybrid` would fail.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import jax

from jhybrid.config import ModelConfig
from jhybrid.models.params import pack_params

log = logging.getLogger("jhybrid.engine")
# generation_config.json fields that become sampling defaults (vLLM's list), by their SamplingParams name
GENERATION_DEFAULT_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclasses.dataclass
class LoadedModel:
    """A config with its parameters (packed for the model on construction), tokenizer, EOS ids and sampling
    defaults (`SamplingParams` fields)."""

    cfg: ModelConfig
    params: Any
    tokenizer: Any = None
    eos_token_ids: tuple[int, ...] = ()
    generation_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    fp8_checkpoint: bool = False  # the checkpoint's weights are block-wise FP8 (dequantized by the reader)

    def __post_init__(self):
        self.params = pack_params(self.params)


def uses_fp8(quantization: str, fp8_checkpoint: bool) -> bool:
    """Whether `quantization` makes the weights FP8: "fp8", or "auto" on an FP8 checkpoint where the GPU has FP8
    tensor cores."""
    from pallas_kernels.fp8_matmul import gpu_has_fp8

    if quantization not in ("auto", "fp8", "none"):
        raise ValueError(f"unknown quantization={quantization!r}; choose one of auto, fp8, none")
    return quantization == "fp8" or (quantization == "auto" and fp8_checkpoint and gpu_has_fp8())


def quantize(model: LoadedModel, quantization: str = "auto", tensor_parallel_size: int = 1) -> LoadedModel:
    """`model` with its dense projections and routed experts as FP8 weights (`jhybrid.models.quant`) when
    `quantization` asks for it (`uses_fp8`), laid out for `tensor_parallel_size` devices (a projection whose split
    is not on whole 128-blocks stays in the load dtype); else `model` itself, also when it holds FP8 weights already
    (quantized as it was loaded: `LLM` loads, then its engine calls this again)."""
    from jhybrid.models.quant import num_fp8_weights, quantize_params
    from jhybrid.parallel.sharding import fp8_layout

    fp8_checkpoint = getattr(model, "fp8_checkpoint", False)
    if not uses_fp8(quantization, fp8_checkpoint):
        if fp8_checkpoint:
            log.info("FP8 checkpoint: weights dequantized to %s (quantization=%s)", model.cfg.dtype, quantization)
        return model
    if num_fp8_weights(model.params):
        return model
    params = quantize_params(model.params, fp8_layout(model.cfg, tensor_parallel_size))
    log_fp8(params, model.cfg.dtype, tensor_parallel_size)
    return dataclasses.replace(model, params=params)


def log_fp8(params: Any, dtype: str, tensor_parallel_size: int = 1) -> None:
    """Logs what `quantize_params` made FP8 and what it left in the load dtype, and why."""
    from jhybrid.models.quant import num_fp8_weights, unquantized

    left = unquantized(params, tensor_parallel_size)
    shown = "; ".join(f"{name} ({why})" for name, why in list(left.items())[:4])
    more = f"; ... and {len(left) - 4} more" if len(left) > 4 else ""
    log.info("quantization fp8: %d projections and %d routed-expert tensors as 128x128-block FP8 weights, %d left in "
             "%s%s; parameters %.2f GB", num_fp8_weights(params, experts=False), num_fp8_weights(params, experts=True),
             len(left), dtype, f": {shown}{more}" if left else "", _param_bytes(params) / 1e9)


def _param_bytes(params: Any) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(params))


def load(model: str | os.PathLike | LoadedModel, dtype: str | None = None, *, host: bool = False,
         quantization: str = "auto", tensor_parallel_size: int = 1) -> LoadedModel:
    """A model directory (HF or converted) or an already loaded model. `host`: read the parameters into
    host memory (JAX's CPU device) instead of the first accelerator, as tensor parallelism wants: they go
    from there straight to their shards, so a model larger than one GPU can be loaded. `quantization`:
    see `quantize` (EngineConfig.quantization); FP8 weights are made layer by layer as the checkpoint is read
    (`jhybrid.checkpoint.load_model`'s `layer_fn`), so the model never exists whole in the load dtype, and laid
    out for `tensor_parallel_size` devices."""
    if isinstance(model, LoadedModel):
        return quantize(model, quantization, tensor_parallel_size)
    if host:
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            return load(model, dtype, quantization=quantization, tensor_parallel_size=tensor_parallel_size)
    from jhybrid.checkpoint import load_model
    from jhybrid.tokenizer import load_tokenizer

    fp8_checkpoint = is_fp8_checkpoint(model)
    layer_fn = None
    if uses_fp8(quantization, fp8_checkpoint):
        from jhybrid.models.params import pack_layer
        from jhybrid.models.quant import quantize_layer
        from jhybrid.parallel.sharding import fp8_layout

        def layer_fn(cfg: ModelConfig, layer: dict) -> dict:
            return quantize_layer(pack_layer(layer), fp8_layout(cfg, tensor_parallel_size))

    cfg, params = load_model(model, dtype=dtype, layer_fn=layer_fn)
    tokenizer = load_tokenizer(model)
    eos = set(cfg.eos_token_ids)
    gen = read_generation_config(model)
    gen_eos = gen.get("eos_token_id")
    eos.update(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
    loaded = LoadedModel(cfg=cfg, params=params, tokenizer=tokenizer, eos_token_ids=tuple(sorted(eos)),
                         generation_defaults=generation_defaults(gen), fp8_checkpoint=fp8_checkpoint)
    del params
    if layer_fn is None:
        return quantize(loaded, quantization, tensor_parallel_size)
    log_fp8(loaded.params, cfg.dtype, tensor_parallel_size)
    return loaded


def is_fp8_checkpoint(model: str | os.PathLike) -> bool:
    """Whether an HF checkpoint directory's config.json declares block-wise FP8 weights."""
    from jhybrid.config_fields import read_quantization_config

    path = os.path.join(model, "config.json")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return read_quantization_config(json.load(f)) is not None


def read_generation_config(model: str | os.PathLike) -> dict[str, Any]:
    """generation_config.json of a checkpoint directory ({} when it has none)."""
    path = os.path.join(model, "generation_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def generation_defaults(gen: dict[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """The sampling defaults of a generation config (or of the checkpoint directory holding one), as
    `SamplingParams` fields: the values it sets of `GENERATION_DEFAULT_FIELDS` (transformers 5 writes only what
    the model's authors set), `max_new_tokens` as `max_tokens`. A value SamplingParams refuses is left out,
    with a warning."""
    from jhybrid.engine.sampling import SamplingParams

    if not isinstance(gen, dict):
        gen = read_generation_config(gen)
    out = {}
    for name, field in GENERATION_DEFAULT_FIELDS.items():
        value = gen.get(name)
        if value is None:
            continue
        try:
            SamplingParams(**{field: value})
        except (TypeError, ValueError) as e:
            log.warning("generation_config.json: %s=%r is not used as a sampling default: %s", name, value, e)
            continue
        out[field] = value
    return out
