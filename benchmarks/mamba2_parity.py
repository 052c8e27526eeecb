"""NemotronH prefill logits on the GPU against HF transformers' fp32 model, for each dtype of the Mamba2 scan.

    PYTHONPATH=. python3 -m benchmarks.mamba2_parity [--json out.json] [--lengths 1024,4608]

Builds a mid-size NemotronH with HF (hidden 1024, 32 Mamba2 heads of 64 in 8 groups, state 128; blocks Mamba2,
MLP, attention, MLP, Mamba2, MLP, as Nemotron-H's: no MoE, whose routing flips under any rounding), random fp32
weights at 1/sqrt(fan-in), saved with `save_pretrained`. HF's torch path gives each prompt's logits in fp32 and in
bf16. jhybrid loads the same files and runs each prompt as one prefill step: in fp32 (the control), then in bf16
once per `JHYBRID_MAMBA2_SCAN_DTYPE` (float32, bfloat16), each in its own subprocess, as the setting is read at
import. A prompt of 4,096 tokens or more runs the chunk kernel's split form, a shorter one its one-pass form
(`simple_gla.MAMBA2_SPLIT_FROM_TOKENS`).

Prints, per prompt, the relative L2 error of the logits against HF fp32 beside HF bf16's own, and the share of
positions whose top-1 token matches HF fp32's. The claim it checks: the bf16 scan's error is of the size bf16
inference has anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

OVERRIDES = dict(
    vocab_size=2048, hidden_size=1024, intermediate_size=2048, num_attention_heads=16, num_key_value_heads=2,
    head_dim=64, mamba_num_heads=32, mamba_head_dim=64, n_groups=8, ssm_state_size=128, chunk_size=128,
    max_position_embeddings=16384,
    layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp"],
)
# (model dtype, JHYBRID_MAMBA2_SCAN_DTYPE): the fp32 model is the control (its scan is fp32 either way)
RUNS = (("float32", "auto"), ("bfloat16", "float32"), ("bfloat16", "bfloat16"))


def log(msg: str) -> None:
    print(msg, flush=True)


def build(path: str):
    """The HF model (fp32, eval, on the GPU where there is one), saved to `path`."""
    import torch

    from tests.hf_models import make_nemotron_h

    model = make_nemotron_h(None, **OVERRIDES)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # weights at 1/sqrt(fan-in), so activations keep their scale through 1024-wide layers
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    model.save_pretrained(path)
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval()


def hf_logits(model, prompts: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """{prompt: {"float32": logits, "bfloat16": logits}}: every prompt in fp32 first, then the model cast to bf16
    (a round trip back to fp32 would leave its weights rounded)."""
    import torch

    out = {name: {} for name in prompts}
    with torch.no_grad():
        for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            model.to(torch_dtype)
            for name, ids in prompts.items():
                x = torch.tensor([ids.tolist()], device=model.device)
                out[name][dtype] = model(x).logits[0].float().cpu().numpy()
    return out


def worker(path: str, dtype: str, prompts: str, out: str) -> None:
    """jhybrid's logits in `dtype` for every prompt in `prompts` (npz of int arrays), to `out` (npz)."""
    from jhybrid.checkpoint import load_model
    from pallas_kernels import simple_gla
    from tests.runner_helpers import SequenceRunner

    ids = dict(np.load(prompts))
    cfg, params = load_model(path, dtype=dtype)
    runner = SequenceRunner(cfg, params, max_len=max(len(v) for v in ids.values()) + 16)
    got = {}
    for name, tokens in ids.items():
        table, slot = runner.start()
        got[name] = np.asarray(runner.step(tokens.tolist(), 0, table, slot, all_logits=True), np.float32)
        runner.finish(table, slot)
    np.savez(out, **got)
    log(f"worker: {dtype} model, scan dtype {simple_gla.MAMBA2_SCAN_DTYPE}, {len(got)} prompts")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--json", help="write {machine_info, rows} here")
    ap.add_argument("--lengths", default="1024,4608", help="prompt lengths, comma-separated")
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "DTYPE", "PROMPTS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    from benchmarks.kernels import machine_info

    info = machine_info()
    log(json.dumps(info))
    rng = np.random.default_rng(3)
    lengths = [int(n) for n in args.lengths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model = build(os.path.join(tmp, "hf"))
        prompts = {f"T{n}": rng.integers(0, OVERRIDES["vocab_size"], n) for n in lengths}
        np.savez(os.path.join(tmp, "prompts.npz"), **prompts)
        ref = hf_logits(model, prompts)
        del model
        log(f"HF built and run in {time.perf_counter() - t0:.1f} s")
        got = {}
        for dtype, scan in RUNS:
            out = os.path.join(tmp, f"jh-{dtype}-{scan}.npz")
            env = dict(os.environ, JHYBRID_MAMBA2_SCAN_DTYPE=scan)
            subprocess.run([sys.executable, "-m", "benchmarks.mamba2_parity", "--worker", os.path.join(tmp, "hf"),
                            dtype, os.path.join(tmp, "prompts.npz"), out], env=env, check=True)
            got[dtype, scan] = dict(np.load(out))

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    def top1(a, b):
        return float(np.mean(a.argmax(-1) == b.argmax(-1)))

    rows = []
    for name in prompts:
        want = ref[name]["float32"]
        runs = [("HF bf16", ref[name]["bfloat16"])]
        runs += [(f"jhybrid {dtype}, scan {scan}", got[dtype, scan][name]) for dtype, scan in RUNS]
        rows += [dict(prompt=name, run=run, rel=rel(logits, want), top1=top1(logits, want)) for run, logits in runs]
    log(f"\nmachine: {info.get('gpu')} | commit {info.get('commit')}")
    log(f"{'prompt':8s} {'run':32s} {'rel err vs HF fp32':>20s} {'top-1 match':>12s}")
    for r in rows:
        log(f"{r['prompt']:8s} {r['run']:32s} {r['rel']:20.3e} {r['top1']:12.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine_info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
