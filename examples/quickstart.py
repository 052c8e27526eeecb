"""Generates with the model that ships inside jhybrid: a 4.5 M-parameter Qwen3.5 hybrid (3 Gated DeltaNet
layers : 1 gated-attention layer) trained on the King James Bible by examples/train_tiny.py.

    .venv/bin/python examples/quickstart.py [--prompt "And God said"] [--max-tokens 40]

The same from the command line: `jhybrid generate --prompt "And God said"` (no --model: the bundled model).
"""

from __future__ import annotations

import argparse
import time

import jhybrid

PROMPTS = ["And God said", "The LORD is my shepherd", "In the beginning", "Blessed are the"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", action="append", help="prompt (repeatable; default: four Bible openings)")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    prompts = args.prompt or PROMPTS

    path = jhybrid.default_model_path()
    llm = jhybrid.LLM(path, dtype="float32", max_num_seqs=len(prompts), max_model_len=64 + args.max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, jhybrid.SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    elapsed = time.perf_counter() - t0
    print(f"bundled model: {path}")
    for prompt, out in zip(prompts, outs):
        print(f"\n{prompt}{out.text}")
    print(f"\n{sum(len(o.token_ids) for o in outs)} tokens in {elapsed:.1f} s (greedy; compilation included)")


if __name__ == "__main__":
    main()
