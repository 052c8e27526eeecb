"""`load(model, dtype)`: a checkpoint directory (HF or converted) -> a `LoadedModel`, what the engine runs:
the config, the parameters packed for the model, the tokenizer and every EOS id (config.json and
generation_config.json).

The checkpoint readers (`jhybrid.checkpoint`, over `converters`) are imported when a directory is loaded, not
with this module: `converters` imports `jhybrid.config`, which runs `jhybrid/__init__.py` and so the engine,
which imports this module; at the top here, `import converters` before `import jhybrid` would fail.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax

from jhybrid.config import ModelConfig
from jhybrid.models.params import pack_params


@dataclasses.dataclass
class LoadedModel:
    """A config with its parameters (packed for the model on construction), tokenizer and EOS ids."""

    cfg: ModelConfig
    params: Any
    tokenizer: Any = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        self.params = pack_params(self.params)


def load(model: str | os.PathLike | LoadedModel, dtype: str | None = None, *, host: bool = False) -> LoadedModel:
    """A model directory (HF or converted) or an already loaded model. `host`: read the parameters into
    host memory (JAX's CPU device) instead of the first accelerator, as tensor parallelism wants: they go
    from there straight to their shards, so a model larger than one GPU can be loaded."""
    if isinstance(model, LoadedModel):
        return model
    if host:
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            return load(model, dtype)
    from jhybrid.checkpoint import load_model
    from jhybrid.tokenizer import load_tokenizer

    cfg, params = load_model(model, dtype=dtype)
    tokenizer = load_tokenizer(model)
    eos = set(cfg.eos_token_ids)
    gen_path = os.path.join(model, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
        eos.update(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
    return LoadedModel(cfg=cfg, params=params, tokenizer=tokenizer, eos_token_ids=tuple(sorted(eos)))
