"""Files that ship inside the jhybrid package: the bundled default model.

`kjv-tiny/` is a 4.5 M-parameter Qwen3.5 hybrid (Gated DeltaNet + gated attention, 3 linear : 1 full) in HF
format, trained by `examples/train_tiny.py` on the King James Bible; its README.md says how it was made.
"""

from __future__ import annotations

import os

DEFAULT_MODEL = "kjv-tiny"


def default_model_path() -> str:
    """The directory of the bundled default model (HF format: config.json, model.safetensors, tokenizer)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), DEFAULT_MODEL)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"the bundled model is missing from {path}; reinstall jhybrid (pip install -e .)")
    return path
