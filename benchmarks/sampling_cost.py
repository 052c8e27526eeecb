"""What the sampling controls cost on the decode step (issue 19: aim <= 10% with all of them on vs greedy).

    PYTHONPATH=. python -m benchmarks.sampling_cost [--batch 64] [--json out.json]
    PYTHONPATH=. python -m benchmarks.sampling_cost --tiny --batch 4          # CPU smoke test

The 2.2 B Qwen3-Next-shaped dense model of benchmarks/generate.py (its full 151,936-token vocabulary: the
controls' work grows with the vocabulary), random bf16 weights made on the device, a synthesised 151,665-token tokenizer
(`--tokenizer`) for the bad words and the grammars. `--batch` rows of 256-token prompts decode 64 tokens under
each setting below, in `--repeat` rounds over the settings (a setting's first pass is a warm one: it pays for any
compile; the engine is warmed up, so none should); a round's figure is the median wall time of the steps in which
every row decodes (the engine dispatches a step before it reads the last one, so in steady state that is the device
step plus any host time not hidden behind it), a setting's the median of its rounds. Every setting runs in the same
engine, in the same process, so greedy is the same-run baseline, and each round is also compared with that round's
greedy (the spread says how far one run can be trusted). Also printed: programs compiled after warm-up
(expected 0), and the engine loop's host phases per decode step (`LLMEngine.step_log`: schedule, prepare and
dispatch, wait for the device, read the results), which tell a host-bound setting from a device-bound one.

The wall time of a step is the device step or the engine's host work, whichever is longer, and on a busy host
it moves by +-15% between identical settings (RESULTS.md). `--trace DIR` also runs each setting's second pass
under the JAX profiler and reports the GPU kernel time per decode step: the kernels that start between the first
and the last decode-only step, divided by the steps, and for each setting the kernels whose time grew most
against greedy. The controls change only the device's sampling work, so
that column is the one to compare.
"""

from __future__ import annotations

import argparse
import collections
import json
import os

import numpy as np

from benchmarks.decode_step import decode_step_times, random_model
from benchmarks.switches import add_set_argument, apply_sets
from benchmarks.trace_gaps import load as load_trace


def settings(vocab: int) -> dict:
    rng = np.random.default_rng(0)
    sampled = dict(temperature=0.8, top_k=50, top_p=0.9, seed=1)
    every = dict(sampled, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                 min_tokens=64, logit_bias={int(t): 2.0 for t in rng.integers(0, vocab, 50)},
                 bad_words=["LORD", "Egypt"], allowed_token_ids=rng.integers(0, vocab, 20000).tolist(), logprobs=5)
    chosen = {
        "greedy": dict(temperature=0.0),
        "sampled (temperature, top-k, top-p)": sampled,
        "penalties (presence, frequency, repetition)": dict(temperature=0.0, presence_penalty=0.5,
                                                            frequency_penalty=0.5, repetition_penalty=1.2),
        "logprobs (top 5)": dict(temperature=0.0, logprobs=5),
        "allowed_token_ids (20,000 ids)": dict(temperature=0.0, allowed_token_ids=every["allowed_token_ids"]),
        "min_p, min_tokens, logit_bias, bad_words": dict(sampled, min_p=0.05, min_tokens=64,
                                                          logit_bias=every["logit_bias"], bad_words=["LORD", "Egypt"]),
        "every control": every,
        "greedy again (run-to-run noise)": dict(temperature=0.0),
    }
    # structured output: a step whose masks need the last step's tokens runs split (forward, then sampling once the
    # host has filled the masks meanwhile); "whole steps" is the path without the split (the host reads the last
    # step into the matchers before it dispatches the next); left out where xgrammar is not installed
    try:
        chosen["structured output (JSON schema, every row)"] = dict(temperature=0.0, structured_outputs=_structured())
        chosen["structured output (JSON schema, every row, whole steps)"] = dict(
            temperature=0.0, structured_outputs=_structured(), _split=False)
        chosen["structured output (JSON schema, sampled)"] = dict(sampled, structured_outputs=_structured())
        chosen["structured output (JSON schema, sampled, whole steps)"] = dict(sampled, structured_outputs=_structured(),
                                                                               _split=False)
    except ImportError as e:
        print(f"structured output settings left out: {e}", flush=True)
    return chosen


def _structured():
    from jhybrid.engine.structured_output import StructuredOutputsParams

    # an array of strings: open-ended, so the rows run all 64 tokens (a grammar that ends would end the rows)
    return StructuredOutputsParams(json={"type": "array", "items": {"type": "string"}})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test of this script)")
    parser.add_argument("--trace", metavar="DIR", help="also measure GPU kernel time per decode step (JAX profiler "
                        "traces written under DIR)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds over the settings (each setting's figure: the "
                        "median of its rounds; each round also compared with that round's greedy)")
    parser.add_argument("--only", help="comma-separated prefixes of the settings to run (greedy always runs)")
    parser.add_argument("--tokenizer", choices=("synth", "bundled"), default="synth",
                        help="synth (default): a byte-level BPE tokenizer of 151,665 tokens (benchmarks/grammar_mask.py) "
                             "for the model's 151,936 ids, as Qwen's; bundled: the example's 4,096-token tokenizer, whose "
                             "147,840 ids beyond it made each grammar mask ~30x slower to fill (benchmarks/RESULTS.md)")
    add_set_argument(parser, "jhybrid.engine.sampling.TOP_K_CHUNK=2048")
    args = parser.parse_args(argv)
    apply_sets(parser, args.set)

    import jax

    import jhybrid
    from jhybrid.assets import default_model_path
    from jhybrid.tokenizer import load_tokenizer

    if args.tokenizer == "synth" and not args.tiny:
        import tempfile

        from benchmarks.grammar_mask import synth_tokenizer
        from jhybrid.tokenizer import HFTokenizer

        folder = tempfile.mkdtemp(prefix="jhybrid-synth-tok-")
        synth_tokenizer(151_665).save(os.path.join(folder, "tokenizer.json"))
        tokenizer = HFTokenizer(folder)
    else:
        tokenizer = load_tokenizer(default_model_path())
    model = random_model(args.tiny, tokenizer=tokenizer)
    cfg = model.cfg
    llm = jhybrid.LLM(model, dtype=None, max_num_seqs=args.batch, max_model_len=512, max_num_batched_tokens=2048,
                      warmup=True)
    eng = llm.engine
    prompts = [np.random.default_rng(i).integers(0, cfg.vocab_size, 256).tolist() for i in range(args.batch)]
    res = {"device": str(jax.devices()[0].device_kind), "batch": args.batch, "vocab": cfg.vocab_size, "ms": {},
           "set": args.set, "tokenizer": args.tokenizer}
    chosen = settings(cfg.vocab_size)
    if args.only:
        prefixes = args.only.split(",")
        chosen = {k: v for k, v in chosen.items() if k == "greedy" or any(k.startswith(p) for p in prefixes)}
    rounds = collections.defaultdict(list)  # setting -> its median step of each round
    for rnd in range(args.repeat):
        for name, kw in chosen.items():
            kw = dict(kw)
            eng.runner.split_sampling = kw.pop("_split", True)
            sp = jhybrid.SamplingParams(max_tokens=64, ignore_eos=True, **kw)
            times = []
            for rep in range(2 if rnd == 0 else 1):  # the first pass of a setting is a warm one
                split_before = eng.runner.num_split_steps
                eng.step_log, eng.runner.call_log = [], []
                times = decode_step_times(eng, prompts, sp, f"{name[:8]}-{rnd}-{rep}")
                eng.runner.wait_split_compiles()  # split programs met in the first pass compile in the background
            res.setdefault("split_steps_measured_pass", {})[name] = eng.runner.num_split_steps - split_before
            rounds[name].append(float(np.median(times[4:])) * 1e3)
            res.setdefault("host_ms_rounds", {}).setdefault(name, []).append(host_phases(eng.step_log,
                                                                                        eng.runner.call_log))
            eng.step_log = eng.runner.call_log = None
            line = f"round {rnd + 1}: {name:45s} {rounds[name][-1]:7.3f} ms / step ({len(times)} all-decode steps)"
            if args.trace and rnd == 0:
                folder = os.path.join(args.trace, f"setting{len(rounds)}")
                res.setdefault("kernel_ms", {})[name], by_kernel = kernel_ms_per_decode_step(eng, prompts, sp, folder)
                res.setdefault("kernel_ms_by_name", {})[name] = by_kernel
                line += f"   kernels {res['kernel_ms'][name]:7.3f} ms / step"
            print(line, flush=True)
    res["ms_rounds"] = dict(rounds)
    res["ms"] = {name: float(np.median(v)) for name, v in rounds.items()}
    res["host_ms"] = {name: {k: float(np.median([r[k] for r in v])) for k in HOST_PHASES}
                      for name, v in res["host_ms_rounds"].items()}
    base = res["ms"]["greedy"]
    res["compiled_after_warmup"] = eng.runner.num_compiled_after_seal
    res["split_programs_compiled"], res["split_steps"] = eng.runner.num_split_compiled, eng.runner.num_split_steps
    print(f"\nbatch {args.batch}, vocab {cfg.vocab_size}, {res['device']}; programs compiled after warm-up: "
          f"{res['compiled_after_warmup']}; split-step program pairs compiled in the background: "
          f"{res['split_programs_compiled']}, split steps: {res['split_steps']}")
    print(f"\nhost time of the measured pass's decode-only steps, median ms (a step is host-bound when its device "
          f"wait is ~0):\n{'setting':45s} " + " ".join(f"{k:>9s}" for k in HOST_PHASES))
    for name, phases in res["host_ms"].items():
        print(f"{name:45s} " + " ".join(f"{phases[k]:9.3f}" for k in HOST_PHASES))
    kernels = res.get("kernel_ms")
    print(f"{'setting':45s} {'ms/step':>8s} {'vs greedy':>10s} {'rounds vs greedy (min..max)':>28s}"
          + (f" {'kernel ms':>10s} {'vs greedy':>10s}" if kernels else ""))
    for name, ms in res["ms"].items():
        # each round's ratio against the same round's greedy (neighbours in time, so slow drifts of the host cancel)
        ratios = [v / g - 1 for v, g in zip(rounds[name], rounds["greedy"])]
        res.setdefault("vs_greedy_rounds", {})[name] = ratios
        line = f"{name:45s} {ms:8.3f} {ms / base - 1:+10.1%} {min(ratios):+13.1%} ..{max(ratios):+7.1%}"
        if kernels:
            line += f" {kernels[name]:10.3f} {kernels[name] / kernels['greedy'] - 1:+10.1%}"
        print(line)
    if kernels:  # where each setting's extra kernel time goes: the kernels that grew most against greedy
        base_k = res["kernel_ms_by_name"]["greedy"]
        for name, by_kernel in res["kernel_ms_by_name"].items():
            if name == "greedy":
                continue
            grew = sorted(((ms - base_k.get(k, 0.0), k) for k, ms in by_kernel.items()), reverse=True)[:12]
            print(f"{name}: " + "; ".join(f"{k[:50]} +{d:.3f}" for d, k in grew if d > 0.004))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


HOST_PHASES = ("schedule", "prepare", "wait", "read+rest", "call", "drain")


def host_phases(log, calls=None) -> dict[str, float]:
    """Median ms of each host phase of the decode-only steps in `log` (`LLMEngine.step_log`): scheduling,
    preparing and dispatching the step, waiting for the device (reading the step before), and the rest (reading
    the results into the requests: detokenising, stop checks, outputs); from `calls` (`ModelRunner.call_log`),
    the step program's call on the dispatch thread (until the step is queued on the device) and the engine's wait
    for the call before it to return (part of "prepare")."""
    steps = [r for r in log if r.prompt_rows == 0][4:]
    decode_calls = [c for c in calls or () if c.program.startswith("decode:")][4:]
    if not steps:
        return dict.fromkeys(HOST_PHASES, float("nan"))
    parts = {"schedule": [r.scheduled - r.start for r in steps], "prepare": [r.dispatched - r.scheduled for r in steps],
             "wait": [r.device_wait for r in steps],
             "read+rest": [r.rest for r in steps],
             "call": [c.returned - c.started for c in decode_calls] or [float("nan")],
             "drain": [c.drain_wait for c in decode_calls] or [float("nan")]}
    return {k: float(np.median(v)) * 1e3 for k, v in parts.items()}


def kernel_ms_per_decode_step(eng, prompts, sp, folder: str) -> tuple[float, dict[str, float]]:
    """GPU kernel time per decode step of `prompts` under `sp`, in all and by kernel name: the engine runs them to
    the end under the JAX
    profiler; the kernels that start inside the window of decode-only steps (marked by a host annotation around
    each `step()`, on the profiler's clock) are summed and divided by the steps in it. The engine dispatches a
    step before it reads the last one, so the window is one step off at each end; over ~60 steps that is noise."""
    import jax

    for i, prompt in enumerate(prompts):
        eng.add_request(f"trace-{i}", prompt, sp)
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        steps = 0
        while eng.has_unfinished():
            decode_only = all(s.num_uncomputed <= 1 for s in eng.scheduler.running) and not eng.scheduler.waiting
            with jax.profiler.TraceAnnotation("decode_only_step" if decode_only else "other_step"):
                eng.step()
            steps += decode_only
    for i in range(len(prompts)):
        eng.release(f"trace-{i}")
    events = load_trace(folder)
    names = {e["pid"]: e["args"].get("name", "") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, n in names.items() if "GPU" in n.upper() and "HOST" not in n.upper()} or set(names)
    marks = [e for e in events if e.get("ph") == "X" and e.get("name") == "decode_only_step"]
    if not marks:
        return float("nan"), {}
    start, end = min(e["ts"] for e in marks), max(e["ts"] + e["dur"] for e in marks)
    busy = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu and start <= e["ts"] < end and e["name"] != "decode_only_step":
            busy[e["name"]] += e.get("dur", 0)
    per_step = {name: us / len(marks) / 1e3 for name, us in busy.items()}
    return sum(per_step.values()), per_step


if __name__ == "__main__":
    raise SystemExit(main())
