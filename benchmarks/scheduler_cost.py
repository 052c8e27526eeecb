"""The host cost of the scheduler with and without prefix caching, no model and no device.

    PYTHONPATH=. python -m benchmarks.scheduler_cost [--rows 64] [--prompt 300] [--max-tokens 64] [--repeat 5]

`--rows` sequences of distinct random `--prompt`-token prompts (no prefix shared, so the cache never hits) are
scheduled and read back the way `LLMEngine.step` does (one step behind: the engine's own read, `LLMEngine._read`,
appends a random token to every sampling row), until all have `--max-tokens` tokens. Printed per setting: microseconds per
step of `Scheduler.schedule()` and of reading the step back, over decode-only steps and over the steps with
prompt tokens, the best of `--repeat` runs. This is the part of a served step's host time that the cache adds
on a load without reuse (benchmarks/RESULTS.md, "Session 20": +0.5 ms a step at 64 rows on the H200's host).
"""

from __future__ import annotations

import argparse
import random
import time

from jhybrid.cache.allocator import BlockAllocator, SlotAllocator
from jhybrid.cache.prefix_cache import PrefixCache
from jhybrid.engine.sampling import SamplingParams
from jhybrid.engine.scheduler import Scheduler
from jhybrid.engine.sequence import Sequence
from tests.test_scheduler_property import HostEngine  # the engine's host half, reading random tokens


def run(args, caching: bool) -> dict[str, float]:
    bs, max_model_len = 16, args.prompt + args.max_tokens + 16
    blocks_needed = args.rows * -(-max_model_len // bs) + 1
    slots = SlotAllocator(args.rows + 1)
    if caching:
        cache = PrefixCache(4 * blocks_needed, bs, range(args.rows + 1, 3 * args.rows + 3), has_state=True)
        blocks = cache.blocks
    else:
        cache, blocks = None, BlockAllocator(blocks_needed, bs)
    sched = Scheduler(blocks, slots, max_num_seqs=args.rows, max_num_batched_tokens=args.batched_tokens,
                      max_model_len=max_model_len, prefix_cache=cache)
    engine = HostEngine(sched, max_model_len, random.Random(0), vocab=args.vocab)
    rng = random.Random(1)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.rows):
        sched.add(Sequence(f"r{i}", [rng.randrange(1, args.vocab) for _ in range(args.prompt)], params))
    times = {"decode": [0.0, 0.0, 0], "prompt": [0.0, 0.0, 0]}
    prev = None
    while sched.has_work() or prev is not None:
        t0 = time.perf_counter()
        out = sched.schedule() if sched.has_work() else None
        t1 = time.perf_counter()
        if prev is not None:
            engine.read(prev)
        t2 = time.perf_counter()
        if out is not None and out.rows:
            kind = "decode" if all(r.num_tokens == 1 for r in out.rows) else "prompt"
            acc = times[kind]
            acc[0], acc[1], acc[2] = acc[0] + t1 - t0, acc[1] + t2 - t1, acc[2] + 1
        prev = out if out is not None and out.rows else None
    return {f"{kind}_{part}": 1e6 * acc[i] / max(acc[2], 1) for kind, acc in times.items()
            for i, part in enumerate(("schedule_us", "read_us"))} | {f"{k}_steps": v[2] for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batched-tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"{args.rows} rows of {args.prompt}-token prompts, {args.max_tokens} new tokens; us per step, best of "
          f"{args.repeat}")
    print(f"{'cache':6} {'decode steps':>12} {'schedule':>9} {'read':>7} {'prompt steps':>13} {'schedule':>9} {'read':>7}")
    for caching in (False, True):
        runs = [run(args, caching) for _ in range(args.repeat)]
        best = {k: min(r[k] for r in runs) for k in runs[0]}
        print(f"{'on' if caching else 'off':6} {best['decode_steps']:>12} {best['decode_schedule_us']:>9.0f} "
              f"{best['decode_read_us']:>7.0f} {best['prompt_steps']:>13} {best['prompt_schedule_us']:>9.0f} "
              f"{best['prompt_read_us']:>7.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
