"""HF checkpoint directory -> converted jhybrid checkpoint directory.

Layout of a converted checkpoint:

    OUT_DIR/
      jhybrid.json     {"format": "jhybrid", "version": 1, "dtype": "bfloat16", "model_type": ..., "num_params": N}
      config.json      the HF config.json, copied unchanged (source of the ModelConfig); from an FP8 checkpoint
                       without its quantization_config (the params are dequantized)
      params/          orbax checkpoint of the flat {dotted jhybrid name: array} dict
      tokenizer.json, tokenizer_config.json, tokenizer.model, generation_config.json, ...  (those present)

Nothing is half-written: everything goes into a temporary directory beside OUT_DIR, renamed into place
at the end. On failure OUT_DIR is left as it was (absent, or its previous contents with overwrite=True).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from converters.dtypes import resolve_dtype
from converters.load import open_hf
from converters.orbax_io import save_flat

FORMAT = "jhybrid"
VERSION = 1
MARKER_FILE = "jhybrid.json"
PARAMS_DIR = "params"
# Copied verbatim when present (tokenizer, generation defaults, chat template).
AUX_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)


def _is_nonempty_dir(path: str) -> bool:
    return os.path.isdir(path) and bool(os.listdir(path))


def convert(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: Any = "bfloat16",
    overwrite: bool = False,
    progress: bool = True,
) -> str:
    """Converts an HF checkpoint into a jhybrid checkpoint.

    Args:
      hf_dir: HF directory (config.json + safetensors).
      out_dir: destination; must not exist, or be empty, unless `overwrite`.
      dtype: "bfloat16" (default), "float16" or "float32" (A_log / dt_bias stay float32).
      overwrite: replace an existing non-empty out_dir (only once the new checkpoint is complete).
      progress: show a tqdm progress bar over tensors.

    Returns:
      The absolute path of out_dir.

    Raises:
      FileExistsError: out_dir is a non-empty directory (or a file) and overwrite is False.
      FileNotFoundError, ConversionError: a missing or inconsistent HF checkpoint.
    """
    from tqdm import tqdm

    hf_dir, out_dir = os.path.abspath(os.fspath(hf_dir)), os.path.abspath(os.fspath(out_dir).rstrip("/"))
    np_dtype = resolve_dtype(dtype)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if _is_nonempty_dir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} is not empty; pass overwrite=True (--overwrite) to replace it")
    if os.path.realpath(out_dir) == os.path.realpath(hf_dir):
        raise ValueError(f"out_dir must differ from hf_dir ({out_dir})")

    with open_hf(hf_dir) as src:  # validates every tensor before anything is written
        parent = os.path.dirname(out_dir)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it private (0700); a checkpoint is shared like any directory
            items = tqdm(src.iter_params(np_dtype), total=len(src.plan), desc="converting", unit="tensor", disable=not progress)
            flat = dict(items)
            save_flat(os.path.join(tmp, PARAMS_DIR), flat)
            num_params = sum(int(a.size) for a in flat.values())
            del flat
            if src.fp8 is None:
                shutil.copyfile(os.path.join(hf_dir, "config.json"), os.path.join(tmp, "config.json"))
            else:  # dequantized: the converted params are not FP8
                with open(os.path.join(tmp, "config.json"), "w") as f:
                    json.dump({k: v for k, v in src.ckpt.config.items() if k != "quantization_config"}, f, indent=2)
            for name in AUX_FILES:
                if os.path.isfile(os.path.join(hf_dir, name)):
                    shutil.copyfile(os.path.join(hf_dir, name), os.path.join(tmp, name))
            marker = {"format": FORMAT, "version": VERSION, "dtype": np_dtype.name, "model_type": src.cfg.model_type, "num_params": num_params}
            with open(os.path.join(tmp, MARKER_FILE), "w") as f:
                json.dump(marker, f, indent=2)
            _replace_dir(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir


def _replace_dir(tmp: str, out_dir: str) -> None:
    """Renames tmp to out_dir; an existing out_dir is moved aside first and restored if the rename fails."""
    if not os.path.exists(out_dir):
        os.rename(tmp, out_dir)
        return
    backup = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(out_dir))
    os.rmdir(backup)
    os.rename(out_dir, backup)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(backup, out_dir)
        raise
    shutil.rmtree(backup, ignore_errors=True)
