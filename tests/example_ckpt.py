"""The tiny random HF checkpoint of examples/tiny_random.py (it has a tokenizer), for tests."""

from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_example_checkpoint(path, seed: int = 0) -> str:
    spec = importlib.util.spec_from_file_location("tiny_random", os.path.join(ROOT, "examples", "tiny_random.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_tiny_checkpoint(str(path), seed=seed)


def merge_json(path, fields: dict) -> None:
    """Adds or replaces `fields` of the JSON file at `path` (a checkpoint's tokenizer_config.json, ...)."""
    with open(path) as f:
        data = json.load(f)
    with open(path, "w") as f:
        json.dump({**data, **fields}, f)
