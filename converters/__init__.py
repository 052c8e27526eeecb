"""HF checkpoint -> jhybrid parameters: per-family name maps, validation, and the converted format.

    from converters import load_hf_params, convert, ConversionError
    cfg, params = load_hf_params("path/to/hf_dir", dtype="bfloat16")
    convert("path/to/hf_dir", "path/to/out_dir")          # orbax checkpoint; see converters.convert
"""

from converters.convert import convert
from converters.load import load_hf_params, open_hf
from converters.plan import ConversionError

__all__ = ["ConversionError", "convert", "load_hf_params", "open_hf"]
