"""Where one engine step's device time goes: a decode step and a small mixed (prefill) step of the 2.2 B
Qwen3-Next-shaped model, traced with the JAX profiler, kernels summed by name.

    PYTHONPATH=. python -m benchmarks.step_profile [--out DIR] [--vocab 4096]
        [--programs mixed:512:64:63,decode:64:64:64]

Builds random bf16 weights on the device (as `benchmarks.startup`), compiles the two programs
(`--programs`, default a 4-row decode step and a 64-token mixed step of 4 rows), runs each a few times, then
traces `--repeats` runs of each (`jax.profiler.trace(create_perfetto_trace=True)`) and prints, per program,
the device kernels with the most total time (per step) and the step's total kernel time. The trace goes to
DIR (`perfetto_trace.json.gz`).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile
import time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--programs", default="mixed:64:4,decode:4:4",
                   help="kind:tokens:rows[:decodes], comma-separated. With a fourth field the step runs real rows "
                        "(each its own state slot and KV pages): that many one-token (decode) rows, and a prompt "
                        "row with the rest of the tokens (mixed), as a server's step beside running decodes; "
                        "a suffix @N puts N tokens of context before every real row (long-context steps)")
    p.add_argument("--tiny", action="store_true", help="a small model (CPU check of the script)")
    p.add_argument("--model", default="qwen3_next", choices=("qwen3_next", "nemotron_h", "minimax"),
                   help="the model shape: the 2.2 B Qwen3-Next-shaped default, or another of `benchmarks.floors`' "
                        "models (NemotronH- and MiniMax-shaped), with --vocab")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="the engine's max_model_len (raise it for programs with a long @context)")
    p.add_argument("--host", action="store_true",
                   help="also print the host-side events (jax/XLA trace annotations, CUDA API calls) with the most "
                        "total time per step: what the step program's call spends its host time on")
    p.add_argument("--hlo", action="store_true",
                   help="also write each program's optimized HLO to DIR/<program>.hlo.txt (to look up a fusion by name)")
    args = p.parse_args(argv)
    for spec in args.programs.split(","):  # a real row's context and new tokens must fit the engine's length
        head, _, context = spec.partition("@")
        fields = head.split(":")  # decode rows take one token each; a mixed step's prompt row the rest
        prompt = int(fields[1]) - int(fields[3]) if len(fields) == 4 and fields[0] != "decode" else 1
        longest = int(context or 0) + max(1, prompt) if len(fields) == 4 else 0
        if longest > args.max_model_len:
            p.error(f"--programs {spec}: a row of {longest} tokens does not fit --max-model-len {args.max_model_len}")
    import jax

    from benchmarks.decode_step import random_params
    from benchmarks.generate import HF_CONFIG
    from jhybrid.config import ModelConfig
    from jhybrid.model_loader import LoadedModel
    from jhybrid.engine.llm_engine import LLMEngine

    if args.model == "qwen3_next":
        hf = dict(HF_CONFIG, model_type="qwen3_next", dtype="bfloat16", vocab_size=args.vocab,
                  max_position_embeddings=max(HF_CONFIG["max_position_embeddings"], args.max_model_len))
        if args.tiny:
            hf.update(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                      linear_value_head_dim=32)
    else:
        from benchmarks.floors import hf_config

        hf = hf_config(args.model, args.tiny)
        hf.update(vocab_size=args.vocab, max_position_embeddings=max(hf["max_position_embeddings"], args.max_model_len))
    cfg = ModelConfig.from_hf(hf)
    tokens = max(int(spec.split(":")[1]) for spec in args.programs.split(","))  # the largest step's tokens
    rows = max(int(spec.partition("@")[0].split(":")[2]) for spec in args.programs.split(","))  # a slot per real row
    eng = LLMEngine(LoadedModel(cfg=cfg, params=random_params(cfg)), max_num_seqs=max(64, rows),
                    max_model_len=args.max_model_len,
                    max_num_batched_tokens=max(2048, tokens))
    runner = eng.runner
    keys, runs = [], {}
    for spec in args.programs.split(","):
        spec, _, context = spec.partition("@")
        context = int(context or 0)
        kind, tokens, rows, *decodes = spec.split(":")
        key = (kind == "decode", int(tokens), int(rows))
        keys.append(key)
        name = "%s t%d r%d" % ("decode" if key[0] else "mixed", key[1], key[2])
        if decodes:
            sizes = [1] * int(decodes[0]) + ([] if key[0] else [key[1] - int(decodes[0])])
            name += " real %d+%s" % (int(decodes[0]), sizes[-1] if not key[0] else 0)
            if context:
                name += " @%d" % context
            runs[name] = lambda sizes=sizes, context=context: run_real_rows(runner, sizes, context)
        else:
            runs[name] = lambda key=key: runner.warm(key)
    runner.compile_all(sorted(set(keys)))
    runner.warm_slot_programs()
    for run in runs.values():
        for _ in range(3):
            run()
    out = args.out or tempfile.mkdtemp()
    if args.hlo:
        os.makedirs(out, exist_ok=True)
        for key, compiled in runner._programs.items():
            if key in set(keys):
                name = "%s_t%d_r%d" % ("decode" if key[0] else "mixed", key[1], key[2])
                with open(os.path.join(out, name + ".hlo.txt"), "w") as f:
                    f.write(compiled.as_text())
    results = {}
    for name, run in runs.items():
        folder = os.path.join(out, name.replace(" ", "_").replace("+", "p"))
        t0 = time.perf_counter()
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(args.repeats):
                run()
        wall = (time.perf_counter() - t0) / args.repeats
        (trace,) = glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)
        with gzip.open(trace) as f:
            events = json.load(f)["traceEvents"]
        # device kernels live on the GPU's process; take complete events whose process is named like a GPU stream
        pids = {e["pid"]: e["args"].get("name", "") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
        gpu = {pid for pid, n in pids.items() if "GPU" in n.upper() and "HOST" not in n.upper()}
        if not gpu:  # no GPU (a CPU check): every process
            print("no GPU process in the trace; processes:", sorted(set(pids.values())))
            gpu = set(pids)
        total = collections.Counter()
        count = collections.Counter()
        for e in events:
            if e.get("ph") == "X" and e.get("pid") in gpu:
                total[e["name"]] += e.get("dur", 0)
                count[e["name"]] += 1
        step_us = sum(total.values()) / args.repeats
        results[name] = dict(wall_ms=wall * 1e3, kernel_ms=step_us / 1e3, num_kernels=sum(count.values()) / args.repeats,
                             top=[(k, v / args.repeats, count[k] / args.repeats) for k, v in total.most_common(args.top)])
        if args.host:
            results[name]["host_top"] = host_events(events, gpu, args.repeats, args.top)
        print(f"\n{name}: wall {wall * 1e3:.2f} ms per step (host included), kernels {step_us / 1e3:.2f} ms, "
              f"{sum(count.values()) / args.repeats:.0f} kernel launches", flush=True)
        for k, v, c in results[name]["top"]:
            print(f"  {v / 1e3:8.3f} ms  x{c:5.0f}  {k[:110]}")
        if args.host:
            print("  host events (total per step, nested events counted in each enclosing one too):")
            for k, v, c in results[name]["host_top"]:
                print(f"  {v / 1e3:8.3f} ms  x{c:5.0f}  {k[:110]}")
    with open(os.path.join(out, "step_profile.json"), "w") as f:
        json.dump(results, f, indent=1)


def host_events(events: list[dict], gpu: set, repeats: int, top: int) -> list[tuple[str, float, float]]:
    """The complete events outside the GPU's processes summed by name: (name, us per step, count per step)."""
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") not in gpu:
            total[e["name"]] += e.get("dur", 0)
            count[e["name"]] += 1
    return [(k, v / repeats, count[k] / repeats) for k, v in total.most_common(top)]


def run_real_rows(runner, sizes: list[int], context: int = 0) -> None:
    """One step of rows of `sizes` tokens, each in its own state slot (1, 2, ...) and its own KV pages, after
    `context` tokens already in the cache (0: one-token rows continue a one-token context, longer rows start the
    sequence); waits for it. The slots' state and the pages' contents are whatever earlier runs left."""
    from jhybrid.engine.sampling import SamplingParams
    from jhybrid.engine.scheduler import ScheduledRow, SchedulerOutput
    from jhybrid.engine.sequence import Sequence

    bs, page, rows = runner.cache.block_size, 1, []
    for i, k in enumerate(sizes):
        length = context + k if context else (k + 1 if k == 1 else k)
        seq = Sequence(f"profile-{i}", [1] * length, SamplingParams(temperature=0.0))
        seq.slot = i + 1
        blocks = -(-length // bs)
        seq.block_table = list(range(page, page + blocks))
        page += blocks
        rows.append(ScheduledRow(seq, length - k, k, True))
    runner.execute(SchedulerOutput(rows, [], []), None).fetch()


if __name__ == "__main__":
    main()
