"""The `jhybrid` command line: generate, convert, inspect.

Every subcommand returns an exit status; user errors (bad paths, inconsistent checkpoints, bad options)
print `error: ...` to stderr and return 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

_DESCRIPTION = """\
jhybrid: a JAX inference engine for hybrid LLMs (full attention + Gated DeltaNet layers).

examples:
  jhybrid convert ./Qwen3-Next-80B-A3B ./qwen3-next-jh --dtype bfloat16
  jhybrid inspect ./qwen3-next-jh
  jhybrid generate --model ./qwen3-next-jh --prompt "The capital of France is" --max-tokens 32
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jhybrid", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    gen = sub.add_parser("generate", help="generate text from one or more prompts", description="Generate text from prompts.")
    gen.add_argument("--model", metavar="DIR", help="HF or converted checkpoint directory (default: the bundled model)")
    gen.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt; repeat for a batch")
    gen.add_argument(
        "--prompt-ids", action="append", default=[], metavar="IDS",
        help="a prompt as comma-separated token ids (e.g. 1,2,3), for checkpoints without a tokenizer; repeatable",
    )
    gen.add_argument("--max-tokens", type=int, default=64, metavar="N", help="new tokens per prompt (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default 0)")
    gen.add_argument("--dtype", default=None, metavar="D", help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    gen.set_defaults(func=_generate)

    conv = sub.add_parser(
        "convert", help="convert an HF safetensors checkpoint to a jhybrid (orbax) checkpoint",
        description="Convert HF_DIR (config.json + safetensors) into OUT_DIR: config.json, jhybrid.json, an orbax "
        "params/ checkpoint and the tokenizer files. OUT_DIR appears only once complete.",
    )
    conv.add_argument("hf_dir", metavar="HF_DIR")
    conv.add_argument("out_dir", metavar="OUT_DIR")
    conv.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | float16 (default bfloat16)")
    conv.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    conv.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    conv.set_defaults(func=_convert)

    insp = sub.add_parser(
        "inspect", help="validate a checkpoint without running it",
        description="Validate an HF or converted checkpoint from its metadata (no weights are loaded): per-layer "
        "kinds, parameter counts, dtypes, KV-cache bytes per token and linear-state bytes per sequence. "
        "Exits non-zero on a missing, unexpected or mis-shaped tensor or an unsupported config.",
    )
    insp.add_argument("dir", metavar="DIR")
    insp.add_argument("--json", action="store_true", help="print the summary as JSON")
    insp.set_defaults(func=_inspect)
    return parser


def _generate(args: argparse.Namespace) -> int:
    if not args.model:
        raise ValueError("the bundled default model is not available yet; pass --model DIR (an HF or converted checkpoint)")
    prompts: list = list(args.prompt)
    for text in args.prompt_ids:
        try:
            prompts.append([int(t) for t in text.split(",") if t.strip()])
        except ValueError:
            raise ValueError(f"--prompt-ids expects comma-separated integers, got {text!r}") from None
    if not prompts:
        raise ValueError("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    from jhybrid.engine.generate import generate

    outputs = generate(args.model, prompts, max_tokens=args.max_tokens, temperature=args.temperature, dtype=args.dtype)
    for i, out in enumerate(outputs):
        if len(outputs) > 1:
            print(f"--- [{i}]")
        text = getattr(out, "text", None)
        print(text if text else " ".join(str(t) for t in out.token_ids))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from converters import convert

    out = convert(args.hf_dir, args.out_dir, dtype=args.dtype, overwrite=args.overwrite, progress=not args.no_progress)
    print(f"wrote {out}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from jhybrid.checkpoint_summary import summarize

    summary = summarize(args.dir)
    print(json.dumps(summary.to_json(), indent=2) if args.json else summary.format())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (0 ok, 2 user error). argparse usage errors exit 2 too."""
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except (OSError, ValueError, ImportError) as e:  # ConversionError is a ValueError
        msg = str(e) if not isinstance(e, ImportError) else f"generation engine unavailable: {e}"
        if isinstance(e, OSError) and e.filename and str(e.filename) not in msg:
            msg = f"{e.filename}: {msg}"
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
