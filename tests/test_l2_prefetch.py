"""`benchmarks/l2_prefetch.py`: the kernel whose extra programs read the next GEMV's weight (session 51's L2 prefetch
probe). Interpreted on the CPU: its first programs' work is the jnp loop it stands for, its prefetch programs read
every chunk of the weight once, and the script's variants are checked against each other before they are timed."""

import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import l2_prefetch


def test_prefetch_programs_read_the_whole_weight_and_leave_the_output_alone():
    """The sink's sums add up to the weight's sum (each of its 4 chunks read once by 2 programs), and the output is
    the tanh loop of the first programs, with or without the prefetch programs. Checked to fail with the prefetch
    programs starting one chunk late (the sum misses a chunk)."""
    key = jax.random.key(0)
    w = jax.random.normal(key, (512, 64), jnp.float32).astype(jnp.bfloat16)  # 4 chunks of CHUNK elements
    x = jax.random.normal(jax.random.fold_in(key, 1), (256,), jnp.float32).astype(jnp.bfloat16)
    want = np.asarray(x, np.float32)
    for _ in range(3):
        want = np.tanh(want * np.float32(1.0001) + np.float32(0.01))
    for prefetch in (0, 2):
        out, sink = l2_prefetch.busy_kernel(x, w, iters=3, prefetch=prefetch, eviction="evict_last", interpret=True)
        np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=1e-2, atol=1e-2)
        if prefetch:
            np.testing.assert_allclose(float(jnp.sum(sink)), float(np.asarray(w, np.float64).sum()), rtol=1e-4)


def test_l2_prefetch_benchmark_runs_on_the_cpu(tmp_path):
    """`--tiny`: every variant timed, and each prefetching chain's GEMV outputs equal the plain chain's."""
    out = tmp_path / "l2.json"
    assert l2_prefetch.main(["--tiny", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    (case,) = row["cases"]
    variants = [v for k, v in case.items() if k.startswith("pf")]
    assert len(variants) == 2 and all(v["same"] and v["us"] > 0 and v["alone_us"] > 0 for v in variants)
    assert row["gemv_us"] > 0 and row["gemv_twice_us"] > 0 and case["kernel_us"] > 0
