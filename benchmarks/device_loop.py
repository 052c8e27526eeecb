"""Batch-1 decode with the host out of the loop: how much of a token's time is the device's (issue 20).

    PYTHONPATH=. python3 -m benchmarks.device_loop [--models qwen3_next,nemotron_h,minimax] [--steps 64]
        [--trace DIR] [--engine-steps 8] [--json out.json] [--tiny] [--variant NAME:MODULE.SWITCH=VALUE[,...]]...

For each model of `benchmarks.floors` (random bf16 weights made on the device), after a 512-token prefill of
one sequence, a decode token is timed three ways:

- `call`: the jitted decode forward called once per token, back to back, on device-resident inputs (what a
  step costs when the host only dispatches it: the program's call, its CUDA-graph launch and the device);
- `loop`: `--steps` decode steps inside one program (`lax.fori_loop`; each step's greedy token, position and
  KV slot computed on the device and fed to the next), so no host work sits between steps;
- `engine`: `LLM.generate`'s steady decode step at batch 1 (`benchmarks.fp8.decode_steps`, as `floors`;
  `--engine-steps N` decode steps a program). With `--trace`, one more engine round is traced (`engine_trace`):
  the device's busy and idle time and its kernels per token, beside the loop's.

Beside them the bytes floor of `floors` (weights a token reads + the fp32 state read and written + the KV, at
the same run's read bandwidth). With `--trace`, the loop is traced once more and its kernels are summed by name
per token (kernel time, launches per token, the top kernels) and by kind (`kernel_kind`: matmul, pallas, cudnn,
xla, copy), the matmul kernels' time beside the weights a token reads. `loop` against `call` is the host's share of a
step that a device-side multi-step decode would remove; `loop` against the floor is the device's own excess.

`--variant` (repeatable) times `call` and `loop` again in the same process with module switches set (the programs
retraced: e.g. `fused:pallas_kernels.gated_delta_rule.FUSED_DECODE=True`,
`conv:pallas_kernels.conv_update.PALLAS_DECODE=True`), after checking one step's logits against the base's from the
same state (relative error), then restores the switches; with `--trace`, each variant's loop kernels too.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import time

import numpy as np

from benchmarks.switches import add_set_argument, apply_sets


def log(*a):
    print(*a, flush=True)


def _decode_inputs(runner, table, slot, position: int, token: int):
    import jax
    import jax.numpy as jnp

    from jhybrid.models import RowSpec, make_batch

    batch = make_batch([RowSpec([token], position, table, slot)], block_size=runner.block_size,
                       max_blocks_per_seq=runner.max_blocks, num_tokens=1, num_rows=1)
    return jax.tree.map(jnp.asarray, batch)


def make_loop(cfg, block_size: int, steps: int):
    """A jitted program of `steps` greedy batch-1 decode steps; returns (tokens [steps], state)."""
    import jax
    import jax.numpy as jnp

    from jhybrid.models import forward

    def run(params, state, batch):
        def body(i, carry):
            state, batch, tokens = carry
            logits, state = forward(cfg, params, state, batch, decode=True)
            token = jnp.argmax(logits[0]).astype(jnp.int32)
            pos = batch.positions + 1
            page = batch.block_tables[0, pos[0] // block_size]
            batch = dataclasses.replace(batch, token_ids=token[None], positions=pos,
                                        slot_mapping=(page * block_size + pos[0] % block_size)[None])
            return state, batch, tokens.at[i].set(token)

        state, _, tokens = jax.lax.fori_loop(0, steps, body, (state, batch, jnp.zeros((steps,), jnp.int32)))
        return tokens, state

    return jax.jit(run, donate_argnums=(1,))


def kernel_sums(folder: str, per: int, top: int, window: tuple[float, float] | None = None) -> dict:
    """Device kernels of the trace in `folder` (those starting inside `window`, trace microseconds, if given),
    summed by name and divided by `per`."""
    (trace,) = glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    pids = {e["pid"]: e["args"].get("name", "") for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, n in pids.items() if "GPU" in n.upper() and "HOST" not in n.upper()} or set(pids)
    total, count = collections.Counter(), collections.Counter()
    lo, hi = window or (-np.inf, np.inf)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu and lo <= e["ts"] < hi:
            total[e["name"]] += e.get("dur", 0)
            count[e["name"]] += 1
    kinds = collections.defaultdict(lambda: [0.0, 0.0])
    for name, us in total.items():
        kind = kinds[kernel_kind(name)]
        kind[0] += us / per / 1e3
        kind[1] += count[name] / per
    return dict(kernel_ms=sum(total.values()) / per / 1e3, launches=sum(count.values()) / per,
                kinds={k: dict(ms=v[0], launches=v[1]) for k, v in sorted(kinds.items())},
                top=[(k, v / per / 1e3, count[k] / per) for k, v in total.most_common(top)])


_MATMUL = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "grouped_matmul", "fp8_matmul", "decode_linear")
# the names jhybrid's Pallas kernels are given (`pallas_call(..., name=...)` in pallas_kernels/)
_PALLAS = ("gdn_", "sgla_", "mamba2_", "lightning_", "paged_", "attn_", "conv_update", "conv_prefill", "top_k_top_p",
           "moe_")


def kernel_kind(name: str) -> str:
    """What a device kernel of the trace is, from its name: `matmul` (XLA's GEMM fusions, cuBLAS / cuBLASLt
    kernels, jhybrid's grouped MoE, FP8 and GEMV kernels), `pallas` (jhybrid's recurrence, conv, attention and
    sampling kernels), `cudnn` (cuDNN's attention), `copy` (memcpy / memset), or `xla` (every other name: XLA's
    fusions for norms, gates, residual adds, split-K reductions, sorts and sampling)."""
    low = name.lower()
    if any(m in low for m in _MATMUL):
        return "matmul"
    if low.startswith(_PALLAS):
        return "pallas"
    if "cudnn" in low or "sdpa" in low or "flash" in low:
        return "cudnn"
    if "memcpy" in low or "memset" in low:
        return "copy"
    return "xla"


_SHAPE = re.compile(r"\b(bf16|f16|f32|s32|u32|s8|u8|pred|f8e4m3fn)\[([0-9,]*)\]")
_ITEMSIZE = dict(bf16=2, f16=2, f32=4, s32=4, u32=4, s8=1, u8=1, pred=1, f8e4m3fn=1)


def fusion_bytes(hlo: str) -> dict[str, int]:
    """For each instruction of the optimized HLO text, the bytes of its result and operands as printed
    (`%name = TYPE[dims] op(TYPE[dims] %a, ...)`): what a kernel of that name moves at least once."""
    out = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*)", line)
        if not m:
            continue
        head = m.group(2).split(", calls=")[0].split(", kind=")[0]
        total = 0
        for dtype, dims in _SHAPE.findall(head):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * _ITEMSIZE[dtype]
        out[m.group(1)] = total
    return out


def small_dots(tiny: bool) -> list[dict]:
    """The decode projections' dot at 1-4 rows on its own: its median time, and whether XLA compiled it as a GEMM
    or as an elementwise product plus a reduction (a `reduce` in the optimized HLO)."""
    import jax
    import jax.numpy as jnp

    shapes = [(64, 32), (128, 64)] if tiny else [(4096, 2048), (2048, 2048), (5632, 2048), (2048, 11264)]
    out = []
    for k, n in shapes:
        w = jax.random.normal(jax.random.key(0), (k, n), jnp.bfloat16)
        for m in (1, 2, 3, 4):
            x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
            f = jax.jit(lambda x, w: x @ w)
            text = f.lower(x, w).compile().as_text()
            f(x, w).block_until_ready()
            times = []
            for _ in range(50):
                t0 = time.perf_counter()
                f(x, w).block_until_ready()
                times.append(time.perf_counter() - t0)
            r = dict(m=m, k=k, n=n, macs=m * k * n, us=float(np.median(times)) * 1e6,
                     reduce=" reduce(" in text, gemm="gemm" in text or "custom-call" in text)
            log(f"dot [{m},{k}] x [{k},{n}] ({m * k * n / 1e6:.1f} M MACs): {r['us']:.1f} us (host-timed call), "
                f"{'reduce' if r['reduce'] else 'no reduce'}, {'GEMM' if r['gemm'] else 'no GEMM'}")
            out.append(r)
    return out


def one_model(name: str, args) -> dict:
    import jax

    from benchmarks.decode_step import random_params
    from benchmarks.floors import byte_counts, hf_config, read_bandwidth
    from jhybrid.config import ModelConfig
    from jhybrid.models.params import flatten_shapes, param_shapes
    from tests.runner_helpers import SequenceRunner, _step

    cfg = ModelConfig.from_hf(hf_config(name, args.tiny))
    counts = byte_counts(cfg, flatten_shapes(param_shapes(cfg)))
    bw = read_bandwidth(args.tiny)
    prompt = 32 if args.tiny else 512
    params = random_params(cfg)  # made once: the engine row below runs on the same weights
    runner = SequenceRunner(cfg, params, max_len=prompt + 2 * args.steps + 64)
    jax.block_until_ready(runner.params)
    table, slot = runner.start()
    logits = runner.step([t % cfg.vocab_size for t in range(1, prompt + 1)], 0, table, slot)
    position, token = prompt, int(np.argmax(np.asarray(logits)))
    experts = counts["experts"] * (counts["top_k"] / counts["num_experts"] if counts["num_experts"] else 1)
    floor_bytes = counts["dense"] + experts + 2 * counts["state"] + counts["kv_per_token"] * (prompt + args.steps)
    floor = floor_bytes / bw * 1e3
    row = dict(model=name, floor_ms=floor, read_tbps=bw / 1e12, weight_bytes=counts["dense"] + experts)

    # call: one program call per token, inputs on the device (the token is not fed back: same work per step)
    batch = _decode_inputs(runner, table, slot, position, token)
    kw = dict(decode=True, all_logits=False, kernel_impl="auto", interpret=False)
    row["call_ms"] = _time_calls(cfg, runner, batch, kw, args.steps)

    # loop: the steps in one program
    loop = make_loop(cfg, runner.block_size, args.steps)
    t0 = time.perf_counter()
    tokens, runner.state = loop(runner.params, runner.state, batch)
    jax.block_until_ready(tokens)
    row["loop_compile_s"] = time.perf_counter() - t0
    row["loop_ms"] = _time_loop(loop, runner, batch, args.steps, compiled=True)
    if args.hlo:
        text = loop.lower(runner.params, runner.state, batch).compile().as_text()
        with open(os.path.join(args.hlo, f"{name}.hlo.txt"), "w") as f:
            f.write(text)
        operand_bytes = fusion_bytes(text)
    if args.trace:
        folder = os.path.join(args.trace, name)
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            tokens, runner.state = loop(runner.params, runner.state, batch)
            jax.block_until_ready(tokens)
        row["loop_kernels"] = kernel_sums(folder, args.steps, args.top)
        if args.hlo:  # each top kernel's operand + result bytes and the bandwidth they imply
            row["loop_kernels"]["top"] = [(k, ms, c, operand_bytes.get(k)) for k, ms, c in row["loop_kernels"]["top"]]
    if args.variant:
        row["variants"] = variants(cfg, runner, batch, kw, name, args)
    del runner  # its state and KV pool
    row["engine_ms"], row["engine_trace"] = engine_step(cfg, params, args, name) if args.engine else (None, None)
    return row


def _parse_variant(text: str) -> tuple[str, list[tuple[object, str, object]]]:
    """`NAME:MODULE.SWITCH=VALUE[,...]` -> (name, [(module, switch, value)])."""
    import ast
    import importlib

    name, _, sets = text.partition(":")
    out = []
    for item in filter(None, sets.split(",")):
        target, _, value = item.partition("=")
        module, _, switch = target.rpartition(".")
        mod = importlib.import_module(module)
        if not hasattr(mod, switch):
            raise SystemExit(f"--variant {text}: {module} has no {switch}")
        out.append((mod, switch, ast.literal_eval(value)))
    return name, out


def variants(cfg, runner, batch, kw, name: str, args) -> list[dict]:
    """Each `--variant`: one step's logits against the base's from a copy of the same state, then `call` and
    `loop` per token (and the loop's kernels with `--trace`), the programs retraced with its switches set."""
    import jax
    import jax.numpy as jnp

    from tests.runner_helpers import _step

    saved = jax.tree.map(jnp.copy, runner.state)

    def one_step():
        logits, _ = _step(cfg, runner.params, jax.tree.map(jnp.copy, saved), batch, **kw)
        return np.asarray(logits, np.float64)

    base = one_step()
    rows = []
    for text in args.variant:
        label, sets = _parse_variant(text)
        before = [(mod, switch, getattr(mod, switch)) for mod, switch, _ in sets]
        for mod, switch, value in sets:
            setattr(mod, switch, value)
        jax.clear_caches()  # the layers' jitted traces read the switches
        try:
            got = one_step()
            r = dict(variant=label, logits_rel_err=float(np.linalg.norm(got - base) / np.linalg.norm(base)))
            runner.state = jax.tree.map(jnp.copy, saved)
            r["call_ms"] = _time_calls(cfg, runner, batch, kw, args.steps)
            loop = make_loop(cfg, runner.block_size, args.steps)
            r["loop_ms"] = _time_loop(loop, runner, batch, args.steps)
            if args.trace:
                folder = os.path.join(args.trace, f"{name}-{label}")
                with jax.profiler.trace(folder, create_perfetto_trace=True):
                    tokens, runner.state = loop(runner.params, runner.state, batch)
                    jax.block_until_ready(tokens)
                r["loop_kernels"] = kernel_sums(folder, args.steps, args.top)
        finally:
            for mod, switch, value in before:
                setattr(mod, switch, value)
            jax.clear_caches()
        log(f"[{name}] variant {label}: logits rel err {r['logits_rel_err']:.2e} against the base; call "
            f"{r['call_ms']:.3f} ms, loop {r['loop_ms']:.3f} ms per token"
            + (f"; loop kernels {r['loop_kernels']['kernel_ms']:.3f} ms in {r['loop_kernels']['launches']:.0f} "
               "launches" if "loop_kernels" in r else ""))
        rows.append(r)
    runner.state = saved
    return rows


def _time_calls(cfg, runner, batch, kw, steps: int) -> float:
    """Median ms per token of `steps` back-to-back calls of the decode forward (after three warm ones)."""
    import jax

    from tests.runner_helpers import _step

    for _ in range(3):
        logits, runner.state = _step(cfg, runner.params, runner.state, batch, **kw)
    jax.block_until_ready(logits)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(steps):
            logits, runner.state = _step(cfg, runner.params, runner.state, batch, **kw)
        jax.block_until_ready(logits)
        times.append((time.perf_counter() - t0) / steps * 1e3)
    return float(np.median(times))


def _time_loop(loop, runner, batch, steps: int, compiled: bool = False) -> float:
    """Median ms per token of the `steps`-step loop program (after one compiling run, unless `compiled`)."""
    import jax

    if not compiled:
        tokens, runner.state = loop(runner.params, runner.state, batch)
        jax.block_until_ready(tokens)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        tokens, runner.state = loop(runner.params, runner.state, batch)
        jax.block_until_ready(tokens)
        times.append((time.perf_counter() - t0) / steps * 1e3)
    return float(np.median(times))


def engine_step(cfg, params, args, name: str) -> tuple[float, dict | None]:
    """The engine row: median ms of `LLM.generate`'s batch-1 decode steps per token (`--engine-steps` decode steps a
    program) and, with `--trace`, `engine_trace`'s figures of one more round."""
    import jhybrid
    from benchmarks.fp8 import decode_steps
    from jhybrid.model_loader import LoadedModel

    prompt, new = (32, 8) if args.tiny else (512, 64)
    llm = jhybrid.LLM(LoadedModel(cfg=cfg, params=params, tokenizer=None), dtype=None, max_num_seqs=args.engine_rows,
                      max_model_len=prompt + 2 * new + 8, max_num_batched_tokens=64 if args.tiny else 2048,
                      num_scheduler_steps=args.engine_steps)
    ms = decode_steps(llm, 1, prompt, new)
    trace = engine_trace(llm, os.path.join(args.trace, f"{name}-engine"), prompt, new, args.top) if args.trace else None
    return ms, trace


def engine_trace(llm, folder: str, prompt_len: int, new: int, top: int) -> dict:
    """One more batch-1 round of the warmed engine under the profiler, its steps annotated as `trace_gaps` reads
    them. Per token of the decode-only steps: the device's busy time (the union of its kernels), the span from the
    first to the last of their kernels, the idle time in gaps, and the kernels summed by kind, as for the loop.
    Busy against the loop's kernels is what the step program adds on the device; span against busy, the time the
    device waited (for the host, or for a program's launch)."""
    import jax

    import jhybrid
    from benchmarks.trace_gaps import gaps, load

    eng = llm.engine
    vocab = eng.model.cfg.vocab_size
    sp = jhybrid.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    seq = eng.add_request("engine-trace", [(5 * t + 3) % vocab for t in range(1, prompt_len + 1)], sp)
    tokens, steps = 0, 0
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        while eng.has_unfinished():
            decode_only = all(s.num_uncomputed <= 1 for s in eng.scheduler.running) and not eng.scheduler.waiting
            before = len(seq.token_ids)
            with jax.profiler.TraceAnnotation("decode_only_step" if decode_only else "other_step"):
                eng.step()
            if decode_only:
                tokens, steps = tokens + len(seq.token_ids) - before, steps + 1
    eng.release("engine-trace")
    events = load(folder)
    marks = [e for e in events if e.get("ph") == "X" and e.get("name") == "decode_only_step"]
    window = (min(e["ts"] for e in marks), max(e["ts"] + e["dur"] for e in marks))
    out = dict(tokens=tokens, steps=steps, kernels=kernel_sums(folder, tokens, top, window))
    if jax.default_backend() == "gpu":  # (a CPU trace has no GPU events to take the union of)
        g = gaps(events, min_us=5.0)
        per = tokens / steps  # `gaps` figures are per step; a multi-step program's step reads several tokens
        out.update(busy_ms=g["busy_ms_per_step"] / per, span_ms=g["span_ms_per_step"] / per,
                   idle_ms_in_gaps=g["idle_ms_per_step_in_gaps"] / per, gaps=g["groups"][:top])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3_next,nemotron_h,minimax", help="comma-separated, from benchmarks.floors")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per timed round (and in the loop program)")
    ap.add_argument("--trace", default=None, help="trace the loop once into DIR/<model> and print its kernels")
    ap.add_argument("--top", type=int, default=15, help="kernels printed per model with --trace")
    ap.add_argument("--no-engine", dest="engine", action="store_false", help="skip the LLM.generate row")
    ap.add_argument("--engine-steps", type=int, default=None, help="the engine row's decode steps a program "
                    "(`num_scheduler_steps`; default: the offline default, which runs these 64-token rows one step "
                    "at a time); with --trace the engine's steps are traced too (busy, idle, kernels per token)")
    ap.add_argument("--engine-rows", type=int, default=1, help="the engine row's max_num_seqs (floors' qwen3_next "
                    "engine has 256: its batch-1 step runs the 4-row program)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--small-dots", action="store_true", help="first, the decode projections' dots alone at 1-4 rows")
    ap.add_argument("--hlo", default=None, help="write the loop program's optimized HLO to DIR/<model>.hlo.txt; with "
                    "--trace, each top kernel's bytes (result + operands) and bandwidth")
    ap.add_argument("--tiny", action="store_true", help="the floors' tiny configs (a CPU check of the script)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:MODULE.SWITCH=VALUE[,...]",
                    help="time call and loop again with these switches (repeatable; see above)")
    add_set_argument(ap, "jhybrid.models.quant.MIN_GEMM_MACS=0")
    args = ap.parse_args(argv)
    apply_sets(ap, args.set)
    rows = []
    if args.small_dots:
        rows.append(dict(model="small_dots", dots=small_dots(args.tiny)))
    for name in filter(None, args.models.split(",")):
        rows.append(one_model(name, args))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        r = rows[-1]
        if "loop_kernels" in r:
            k = r["loop_kernels"]
            log(f"[{name}] loop kernels per token: {k['kernel_ms']:.3f} ms in {k['launches']:.0f} launches "
                f"(loop {r['loop_ms']:.3f} ms: {r['loop_ms'] - k['kernel_ms']:.3f} ms between kernels)")
            for kind, v in k["kinds"].items():
                extra = ""
                if kind == "matmul":  # the weights a token reads, over the matmul kernels' time
                    extra = (f"  ({r['weight_bytes'] / 1e6:,.0f} MB of weights: {r['weight_bytes'] / v['ms'] / 1e9:.2f}"
                             f" TB/s; at the read rate {r['weight_bytes'] / (r['read_tbps'] * 1e12) * 1e3:.3f} ms)")
                log(f"  {kind:<7} {v['ms']:8.4f} ms  x{v['launches']:6.1f}{extra}")
            for kname, ms, c, *nbytes in k["top"]:
                extra = ""
                if nbytes and nbytes[0]:
                    extra = f"  {nbytes[0] / 1e6:7.2f} MB  {nbytes[0] * c / ms / 1e9:6.2f} TB/s"
                log(f"  {ms:8.4f} ms  x{c:5.1f}{extra}  {kname[:100]}")
        if r.get("engine_trace"):
            t, k = r["engine_trace"], r["engine_trace"]["kernels"]
            busy = (f"device busy {t['busy_ms']:.3f} ms, span {t['span_ms']:.3f} ms, idle in gaps of 5 us or more "
                    f"{t['idle_ms_in_gaps']:.3f} ms; " if "busy_ms" in t else "")
            log(f"[{name}] engine per token ({t['tokens']} tokens in {t['steps']} decode steps): {busy}kernels "
                f"{k['kernel_ms']:.3f} ms in {k['launches']:.0f} launches")
            for kind, v in k["kinds"].items():
                log(f"  {kind:<7} {v['ms']:8.4f} ms  x{v['launches']:6.1f}")
            for kname, ms, c in k["top"]:
                log(f"  {ms:8.4f} ms  x{c:5.1f}  {kname[:100]}")
            for g in t.get("gaps", [])[:6]:
                log(f"  gap {g['us_per_step']:8.1f} us/step x{g['count_per_step']:4.1f}  {g['before'][:40]} -> "
                    f"{g['after'][:40]}  host: {[h for h, _ in g['host_at_resume'][:2]]}")
    log("\n| model | floor ms | call ms | loop ms | engine ms | call / floor | loop / floor | engine / floor |")
    log("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if r["model"] == "small_dots":
            continue
        e = r["engine_ms"]
        log(f"| {r['model']} | {r['floor_ms']:.3f} | {r['call_ms']:.3f} | {r['loop_ms']:.3f} | "
            f"{'-' if e is None else f'{e:.3f}'} | {r['call_ms'] / r['floor_ms']:.2f}x | "
            f"{r['loop_ms'] / r['floor_ms']:.2f}x | {'-' if e is None else f'{e / r['floor_ms']:.2f}x'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
