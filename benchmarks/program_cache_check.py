"""The step-program cache (jhybrid/engine/program_cache.py) on the device: a second process that loads every
step program from the cache, without tracing, generates the same tokens as the first, which compiled them.

    PYTHONPATH=. python3 -m benchmarks.program_cache_check [--model DIR] [--json PATH]

Each phase is a fresh process (`--phase compile|load`, started by this one) with the same cache folder; the
prompts are greedy and sampled (seeded), 32 tokens each, 16 at once. Exit status 1 when the tokens differ or the
second process traced a step program.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def phase(model: str, cache: str) -> dict:
    from jhybrid.engine.compilation import enable_compilation_cache

    enable_compilation_cache(cache)
    import jax

    from jhybrid import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, max_num_seqs=16, max_model_len=512, warmup=True)
    ready = time.perf_counter() - t0
    runner = llm.engine.runner
    prompts = [f"And it came to pass in the {i}th year" for i in range(16)]
    params = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True) for i in range(16)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    cache_obj = runner.program_cache
    return dict(device=jax.devices()[0].device_kind, ready_s=round(ready, 2), lower_s=round(runner.lower_seconds, 3),
                programs=len(runner._programs), hits=cache_obj.hits if cache_obj else None,
                misses=cache_obj.misses if cache_obj else None, tokens=[o.outputs[0].token_ids for o in outs])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--phase", choices=("compile", "load"))
    ap.add_argument("--cache")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.model is None:
        from jhybrid.assets import default_model_path

        a.model = default_model_path()
    if a.phase:
        print(json.dumps(phase(a.model, a.cache)), flush=True)
        return 0
    cache = tempfile.mkdtemp(prefix="program-cache-")
    res = {}
    for name in ("compile", "load"):
        out = subprocess.run([sys.executable, "-m", "benchmarks.program_cache_check", "--phase", name, "--cache", cache,
                              "--model", a.model], capture_output=True, text=True, env=dict(os.environ))
        if out.returncode != 0:
            print(out.stderr[-3000:])
            print(f"phase {name} failed with status {out.returncode}")
            return 1
        res[name] = json.loads(out.stdout.strip().splitlines()[-1])
    same = res["compile"]["tokens"] == res["load"]["tokens"]
    for name, r in res.items():
        print(f"{name:8s}: {r['device']}, ready in {r['ready_s']} s, tracing {r['lower_s']} s, {r['programs']} step "
              f"programs, cache hits {r['hits']} misses {r['misses']}")
    print(f"same tokens: {same}; the load phase traced nothing: {res['load']['lower_s'] == 0}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if same and res["load"]["lower_s"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
