"""Prefix caching under serving (issue 21's "Must show" on the H200): a shared-prefix workload and a multi-turn
chat, each against `jhybrid serve`'s app with the cache off and on, in one run.

    PYTHONPATH=. python -m benchmarks.prefix_serve [--json out.json]               # the issue's sizes
    PYTHONPATH=. python -m benchmarks.prefix_serve --tiny --json /tmp/ps.json      # CPU smoke test
    PYTHONPATH=. python -m benchmarks.prefix_serve --only shared --order shuffled --cache all --groups 20 \\
        --num-kv-blocks 5000 --snapshot-slots 12 --host-gb 16   # a device cache too small: the host tier

The model is the 2.2 B Qwen3-Next-shaped dense hybrid of benchmarks/generate.py (Gated DeltaNet + full
attention, its 151,936-token vocabulary, random bf16 weights made on the device); prompts are token ids, so no
tokenizer is involved. The server is the real app (`create_app` over an `AsyncEngine` on a thread, HTTP over
loopback, streamed `/v1/completions`, greedy, EOS ignored), built once with `--enable-prefix-caching` off and
once on (each warmed up: nothing compiles on the request path), the same request list sent to both; `--cache
tier` (or `all`: off, on and tier) runs the cache with a host tier of `--host-gb` GiB, where blocks and snapshots
evicted from the device go (`--num-kv-blocks` and `--snapshot-slots` shrink the device's share to make it matter).

- **shared prefix**: `--groups` groups of `--per-group` requests; a group's requests share a `--system`-token
  system prompt and each has its own `--question`-token question; `--max-tokens` new tokens; requests are sent
  group after group (`--order group`, the default: each group's first requests arrive together, before any of
  them is cached) or in a random order (`--order shuffled`, as vLLM's prefix-caching benchmarks send them), at
  most `--concurrency` in flight.
- **multi-turn**: `--conversations` chats of `--turns` turns run side by side (one request in flight per
  chat); each turn's prompt is the whole history (every earlier question and answer) plus a new
  `--question`-token question.

Reported per workload and setting: TTFT P50 / P99 (from the request's start to its first streamed token),
input tokens/s (prompt tokens sent over the wall time), the hit rate (the server's
`usage.prompt_tokens_details.cached_tokens` over prompt tokens), and for multi-turn the prompt tokens the
server computed per turn (prompt - cached) against the turn's new tokens; programs compiled after ready
(expected 0).

`--trace` also logs every engine step (`LLMEngine.step_log`: host phases, rows, prompt tokens, device wait) and
explains each request's TTFT from the steps inside it (the engine runs on a thread of this process, so the
client's clock is the engine's): how many steps, and their time split into scheduling, preparing and
dispatching, waiting for the device, and the rest of the loop (reading results, detokenizing, streaming).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import time

import numpy as np

from benchmarks.decode_step import random_model
from benchmarks.serve_load import one_request, percentiles


async def stream(host: str, port: int, body: dict, timeout: float) -> dict:
    """One streamed completion (benchmarks.serve_load's client): ttft (s), output token ids, prompt and cached
    tokens."""
    sent = time.perf_counter()
    r = await one_request(host, port, "/v1/completions", body, None, timeout)
    return {"ok": r.ok, "ttft": r.ttft, "tokens": r.token_ids, "cached": r.num_cached_tokens,
            "prompt": r.num_prompt_tokens, "error": r.error, "sent": sent}


def body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "logprobs": 0}  # logprobs: the output's token ids


async def shared_prefix(host, port, model, a, vocab) -> tuple[list[dict], float]:
    rng = np.random.default_rng(0)
    prompts = []
    for _ in range(a.groups):
        system = rng.integers(0, vocab, a.system).tolist()
        prompts += [system + rng.integers(0, vocab, a.question).tolist() for _ in range(a.per_group)]
    if a.order == "shuffled":
        rng.shuffle(prompts)
    gate = asyncio.Semaphore(a.concurrency)

    async def one(p):
        async with gate:
            return await stream(host, port, body(model, p, a.max_tokens), a.timeout)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    for r, p in zip(results, prompts):
        r["prompt"] = r["prompt"] or len(p)
    return results, time.perf_counter() - t0


async def multi_turn(host, port, model, a, vocab) -> tuple[list[dict], float]:
    """The history grows by each turn's question and the model's answer (its token ids, from the streamed
    logprobs: the model has no tokenizer, so they read "token_id:N")."""
    rng = np.random.default_rng(1)
    questions = [[rng.integers(0, vocab, a.question).tolist() for _ in range(a.turns)] for _ in range(a.conversations)]

    async def chat(c):
        history, out = [], []
        for t in range(a.turns):
            prompt = history + questions[c][t]
            r = await stream(host, port, body(model, prompt, a.max_tokens), a.timeout)
            r.update(turn=t, new=len(questions[c][t]), prompt=r["prompt"] or len(prompt))
            out.append(r)
            history = prompt + r["tokens"]
        return out

    t0 = time.perf_counter()
    results = [r for rs in await asyncio.gather(*(chat(c) for c in range(a.conversations))) for r in rs]
    return results, time.perf_counter() - t0


def explain_ttft(results: list[dict], steps: list) -> dict:
    """Per class of request (prefix hit / miss), the mean of: TTFT, steps that started inside it, and the time
    of those steps by phase (ms). `steps`: `LLMEngine.step_log` (StepRecords)."""
    starts = np.array([s.start for s in steps])
    out = {}
    for name, group in (("hit", [r for r in results if r["ok"] and r["cached"]]),
                        ("miss", [r for r in results if r["ok"] and not r["cached"]])):
        if not group:
            continue
        acc = collections.defaultdict(list)
        for r in group:
            lo, hi = np.searchsorted(starts, [r["sent"], r["sent"] + r["ttft"]])
            window = steps[lo:hi]
            acc["ttft_ms"].append(r["ttft"] * 1e3)
            acc["steps"].append(len(window))
            acc["schedule_ms"].append(sum(s.scheduled - s.start for s in window) * 1e3)
            acc["prepare_dispatch_ms"].append(sum(s.dispatched - s.scheduled for s in window) * 1e3)
            acc["device_wait_ms"].append(sum(s.device_wait for s in window) * 1e3)
            acc["rest_of_loop_ms"].append(sum(s.rest for s in window) * 1e3)
            acc["between_steps_ms"].append(sum(b.start - s.end for s, b in zip(window, window[1:])) * 1e3)
            acc["prompt_tokens_in_steps"].append(sum(s.prompt_tokens for s in window))
        out[name] = {"requests": len(group), **{k: float(np.mean(v)) for k, v in acc.items()}}
    return out


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["ok"]]
    prompt = sum(r["prompt"] for r in ok)
    s = {"requests": len(results), "errors": len(results) - len(ok), "wall_s": wall,
         "ttft_s": percentiles([r["ttft"] for r in ok]), "input_tokens_per_s": prompt / wall,
         "hit_rate": sum(r["cached"] for r in ok) / max(prompt, 1),
         "first_errors": [r["error"] for r in results if not r["ok"]][:3],
         "per_request": [[round(r["ttft"] * 1e3, 2), r["cached"], r["prompt"]] for r in ok]}  # TTFT ms, cached, prompt
    if ok and "turn" in ok[0]:
        turns = sorted({r["turn"] for r in ok})
        s["computed_per_turn"] = [float(np.mean([r["prompt"] - r["cached"] for r in ok if r["turn"] == t])) for t in turns]
        s["prompt_per_turn"] = [float(np.mean([r["prompt"] for r in ok if r["turn"] == t])) for t in turns]
        s["new_per_turn"] = [float(np.mean([r["new"] for r in ok if r["turn"] == t])) for t in turns]
    return s


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=50)
    parser.add_argument("--per-group", type=int, default=10)
    parser.add_argument("--system", type=int, default=10240, help="system prompt tokens")
    parser.add_argument("--question", type=int, default=256, help="question tokens (per request / turn)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=5)
    parser.add_argument("--conversations", type=int, default=5)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--only", choices=["shared", "multi"], help="one workload")
    parser.add_argument("--num-kv-blocks", type=int, help="device KV blocks (default: the memory plan's)")
    parser.add_argument("--snapshot-slots", type=int, help="device snapshot slots (default: the memory plan's)")
    parser.add_argument("--host-gb", type=float, default=0.0,
                        help="host tier GiB of the setting 'tier'")
    parser.add_argument("--cache", choices=["off", "on", "both", "tier", "all"], default="both",
                        help="the servers to run (default both: the comparison)")
    parser.add_argument("--order", choices=["group", "shuffled"], default="group",
                        help="shared prefix: requests group after group (default) or in a random order")
    parser.add_argument("--trace", action="store_true", help="log every engine step and explain the TTFTs")
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and small sizes (CPU smoke test)")
    a = parser.parse_args(argv)

    import jax

    from jhybrid.engine.llm_engine import LLMEngine
    from jhybrid.engine.engine_config import EngineConfig
    from jhybrid.server import BackgroundServer, ServerConfig, create_app
    from jhybrid.server.async_engine import AsyncEngine

    if a.tiny:
        a.groups, a.per_group, a.system, a.question, a.max_tokens = 2, 4, 200, 24, 8
        a.conversations, a.turns, a.max_num_batched_tokens = 2, 3, 128
    longest = max(a.system + a.question, a.turns * (a.question + a.max_tokens)) + a.max_tokens
    max_len = 1 << (longest - 1).bit_length()
    model = random_model(a.tiny, max_position_embeddings=max_len)
    cfg = model.cfg
    rows = max(a.concurrency, a.conversations)
    res = {"device": str(jax.devices()[0].device_kind), "args": vars(a), "runs": {}}
    workloads = {"shared": shared_prefix, "multi": multi_turn}
    if a.only:
        workloads = {a.only: workloads[a.only]}
    settings = {"off": ("off",), "on": ("on",), "both": ("off", "on"), "tier": ("tier",),
                "all": ("off", "on", "tier")}[a.cache]
    for setting in settings:
        cached = setting != "off"
        t0 = time.perf_counter()
        tier = dict(host_kv_memory_gb=a.host_gb, preemption_mode="auto") if setting == "tier" else {}
        if setting == "tier" and not a.host_gb:
            parser.error("--cache tier needs --host-gb")
        config = EngineConfig(dtype=None, max_num_seqs=rows, max_model_len=max_len, warmup=True,
                              max_num_batched_tokens=a.max_num_batched_tokens, gpu_memory_utilization=0.6,
                              enable_prefix_caching=cached, num_kv_blocks=a.num_kv_blocks,
                              prefix_snapshot_slots=a.snapshot_slots if cached else None, **tier)
        engine = AsyncEngine(LLMEngine(model, config), model_name="m")
        server = BackgroundServer(create_app(engine, ServerConfig(model_names=("m",)))).start()
        print(f"server (prefix caching {setting}) ready in {time.perf_counter() - t0:.1f} s", flush=True)
        host, port = server.url.removeprefix("http://").split(":")
        try:
            for name, run in workloads.items():
                if a.trace:
                    engine.engine.step_log = []
                results, wall = asyncio.run(run(host, int(port), "m", a, cfg.vocab_size))
                s = res["runs"][f"{name} / {setting}"] = summarize(results, wall)
                if a.trace:
                    s["ttft_explained"] = explain_ttft(results, engine.engine.step_log)
                    s["step_log"] = [[round(x, 6) for x in step] for step in engine.engine.step_log]
                    s["sent"] = [round(r["sent"], 6) for r in results]
                    for cls, e in s["ttft_explained"].items():
                        print(f"    {cls:4s} x{e['requests']}: TTFT {e['ttft_ms']:.1f} ms = {e['steps']:.1f} steps: "
                              f"schedule {e['schedule_ms']:.1f}, prepare+dispatch {e['prepare_dispatch_ms']:.1f}, "
                              f"device wait {e['device_wait_ms']:.1f}, rest of loop {e['rest_of_loop_ms']:.1f}, "
                              f"between steps {e['between_steps_ms']:.1f} ms; {e['prompt_tokens_in_steps']:.0f} "
                              "prompt tokens", flush=True)
                print(f"  {name:7s} {wall:8.2f} s  TTFT p50 {s['ttft_s']['p50'] * 1e3:9.1f} ms  p99 "
                      f"{s['ttft_s']['p99'] * 1e3:9.1f} ms  hit rate {s['hit_rate']:6.1%}  errors {s['errors']}",
                      flush=True)
            stats = engine.engine.stats()
            res[f"compiled_after_ready_{setting}"] = stats["programs_compiled_after_ready"]
            res[f"compiled_after_ready_names_{setting}"] = list(engine.engine._after_ready.names)
            res[f"engine_stats_{setting}"] = {k: v for k, v in stats.items() if k.startswith(("prefix", "kv_blocks", "host_"))
                                              or k in ("num_steps", "num_preemptions", "device_wait_seconds")}
        finally:
            server.stop()
            engine.shutdown()
            del engine, server
            gc.collect()

    print(f"\n{res['device']}; programs compiled after ready: " + ", ".join(
        f"{k.rsplit('_', 1)[1]} {v}" for k, v in res.items() if k.startswith("compiled_after_ready") and "names" not in k))
    for k, v in res.items():
        if k.startswith("compiled_after_ready_names") and v:
            print(f"  compiled after ready ({k.rsplit('_', 1)[1]}): {', '.join(v)}")
    print(f"{'workload':10s} {'cache':>5s} {'TTFT p50 ms':>12s} {'TTFT p99 ms':>12s} {'input tok/s':>12s} "
          f"{'hit rate':>9s} {'errors':>6s}")
    for key, s in res["runs"].items():
        name, setting = key.split(" / ")
        print(f"{name:10s} {setting:>5s} {s['ttft_s']['p50'] * 1e3:12.1f} {s['ttft_s']['p99'] * 1e3:12.1f} "
              f"{s['input_tokens_per_s']:12.0f} {s['hit_rate']:9.1%} {s['errors']:6d}")
    for name in workloads:
        off = res["runs"].get(f"{name} / off")
        for setting in ("on", "tier"):
            on = res["runs"].get(f"{name} / {setting}")
            if off and on:
                print(f"{name}: TTFT p50 {off['ttft_s']['p50'] / on['ttft_s']['p50']:.2f}x lower with the cache "
                      f"({setting})")
    if "multi / on" in res["runs"]:
        on = res["runs"]["multi / on"]
        print("multi-turn, per turn (cache on): prompt tokens " + ", ".join(f"{x:.0f}" for x in on["prompt_per_turn"]))
        print("                                 computed      " + ", ".join(f"{x:.0f}" for x in on["computed_per_turn"]))
        print("                                 new           " + ", ".join(f"{x:.0f}" for x in on["new_per_turn"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if all(s["errors"] == 0 for s in res["runs"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
