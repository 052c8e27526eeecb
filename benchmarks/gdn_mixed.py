"""The Gated DeltaNet kernels on the shapes a serving step has: a mixed step is a few prompt rows beside many
one-token decode rows, padded to the step's row and token buckets (issue 16's ITL tail).

    PYTHONPATH=. python -m benchmarks.gdn_mixed [--baseline OLD_CHUNK_PY] [--json PATH]

Per case (the model's GDN shape: 16 key / 32 value heads of dim 128, bf16, one layer): the chunked kernel
`chunk_gated_delta_rule_pallas` checked on the GPU against the jnp reference (output and the live slots'
state), then timed; `--baseline` names another copy of `pallas_kernels/gated_delta_rule/chunk.py` (e.g. the
last commit's, `git show HEAD~1:pallas_kernels/gated_delta_rule/chunk.py > /tmp/old_chunk.py`) timed on the
same inputs in the same run; the decode kernel `fused_recurrent_gated_delta_rule_pallas` on the decode rows
alone is the floor a step of only decodes would pay. Prints a table; `--json` writes the rows.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels import errors, time_jax
from pallas_kernels.gated_delta_rule import (
    chunk_gated_delta_rule_pallas,
    chunk_gated_delta_rule_reference,
    fused_recurrent_gated_delta_rule_pallas,
)

H, HV, K, V = 16, 32, 128, 128

# name: (row lengths, padded tokens, padded rows)
CASES = {
    "4 rows (61+1+1+1), t64 r64": ([61, 1, 1, 1], 64, 64),
    "1 prompt of 512, r64": ([512], 512, 64),
    "63 decodes + 313 prompt, t512 r64": ([1] * 63 + [313], 512, 64),
    "63 decodes + 65 prompt, t128 r64": ([1] * 63 + [65], 128, 64),
    "32 decodes + 2 x 200, t512 r64": ([1] * 32 + [200, 200], 512, 64),
    "63 decodes + 1985 prompt, t2048 r64": ([1] * 63 + [1985], 2048, 64),
    "16 prompts of 128, t2048 r64": ([128] * 16, 2048, 64),
    "64 prompts of 32, t2048 r64": ([32] * 64, 2048, 64),
    "1 prompt of 32768, r1": ([32768], 32768, 1),
}
# other settings of the current kernel, timed (and checked) beside its default
VARIANTS = {"rows in 1 group": dict(row_groups=1), "rows in 8 groups": dict(row_groups=8)}


def inputs(lengths, num_tokens, num_rows, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    nrm = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = nrm(jax.random.normal(keys[0], (num_tokens, H, K))).astype(jnp.bfloat16)
    k = nrm(jax.random.normal(keys[1], (num_tokens, H, K))).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (num_tokens, HV, V)).astype(jnp.bfloat16)
    g = jax.nn.log_sigmoid(jax.random.normal(keys[3], (num_tokens, HV)) + 3.0)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (num_tokens, HV)))
    cu = np.zeros(num_rows + 1, np.int32)
    cu[1 : len(lengths) + 1] = np.cumsum(lengths)
    cu[len(lengths) + 1 :] = cu[len(lengths)]
    num_slots = num_rows + 2
    state = jax.random.normal(keys[5], (num_slots, HV, K, V), jnp.float32) * 0.1
    slots = np.zeros(num_rows, np.int32)
    slots[: len(lengths)] = np.arange(1, len(lengths) + 1)
    return q, k, v, g, beta, jnp.asarray(cu), state, jnp.asarray(slots)


def check(fn, args, lengths):
    want_o, want_s = jax.jit(chunk_gated_delta_rule_reference)(*args)
    got_o, got_s = fn(*args)
    live = np.arange(1, len(lengths) + 1)
    n = int(sum(lengths))
    e_o = errors(np.asarray(got_o, np.float32)[:n], np.asarray(want_o, np.float32)[:n])
    e_s = errors(np.asarray(got_s)[live], np.asarray(want_s)[live])
    return max(e_o[1], e_s[1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=None, help="path of another chunk.py to time beside the current one")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    fns = {"now": jax.jit(chunk_gated_delta_rule_pallas)}
    fns.update({name: jax.jit(functools.partial(chunk_gated_delta_rule_pallas, **kw)) for name, kw in VARIANTS.items()})
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_chunk", args.baseline)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        fns["baseline"] = jax.jit(mod.chunk_gated_delta_rule_pallas)
    decode = jax.jit(fused_recurrent_gated_delta_rule_pallas)
    rows = []
    for name, (lengths, num_tokens, num_rows) in CASES.items():
        a = inputs(lengths, num_tokens, num_rows)
        row = dict(case=name)
        for label, fn in fns.items():
            row[f"{label}_rel_err"] = check(fn, a, lengths)
            row[f"{label}_ms"] = time_jax(fn, a, reps=20)[0]
        num_dec = sum(1 for n in lengths if n == 1)
        if num_dec:
            q, k, v, g, beta, cu, state, slots = a
            d = (q[:num_dec], k[:num_dec], v[:num_dec], g[:num_dec], beta[:num_dec], state, slots[:num_dec])
            row["decode_kernel_ms"] = time_jax(decode, d, reps=20)[0]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{jax.devices()[0].device_kind}, one GDN layer (H{H} HV{HV} K{K} V{V} bf16), ms")
    print(f"{'case':40s} {'now':>8s} {'rel err':>9s} {'baseline':>9s} {'speedup':>8s} {'decode rows':>12s}")
    for r in rows:
        for name in VARIANTS:
            print(f"  {r['case']}: {name} {r[f'{name}_ms']:.4f} ms (rel err {r[f'{name}_rel_err']:.2e})")
    for r in rows:
        base = r.get("baseline_ms")
        print(f"{r['case']:40s} {r['now_ms']:8.4f} {r['now_rel_err']:9.2e} "
              f"{base if base is None else format(base, '9.4f'):>9} "
              f"{'-' if base is None else format(base / r['now_ms'], '8.2f'):>8} "
              f"{format(r['decode_kernel_ms'], '12.4f') if 'decode_kernel_ms' in r else '-':>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
