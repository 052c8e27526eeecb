"""`pallas_kernels.decode_linear.gemv_pallas`: a decode step's `x @ w` at a few rows, split over columns and K.
Against float64 on random inputs (interpreted), its default tiles, and lowered for the H200."""

from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp

from pallas_kernels.decode_linear.gemv import MAX_ROWS, default_tiles, gemv_pallas, supported
from tests.test_kernels_pallas import assert_close, lower_for_h200


@pytest.mark.parametrize("rows,k_dim,n_out,tiles,dtype", [
    (1, 256, 128, dict(block_n=64, block_k=64, splits=1), jnp.float32),
    (3, 512, 192, dict(block_n=64, block_k=64, splits=4), jnp.float32),
    (4, 384, 256, dict(block_n=128, block_k=128, splits=3), jnp.bfloat16),
    (MAX_ROWS, 256, 96, dict(block_n=32, block_k=64, splits=2), jnp.float32),
])
def test_gemv_matches_fp64(rows, k_dim, n_out, tiles, dtype):
    """Ragged rows (1, 3, 4, 16 of a 16-row tile), K split in 1-4 parts (3: not a power of two), against float64.
    Checked to fail with every split's partial sums written to split 0's rows (`split * num_rows` dropped from the
    store) and with the K offset of a split left out of the loads."""
    rng = np.random.default_rng(rows * 31 + k_dim)
    x = jnp.asarray(rng.normal(size=(rows, k_dim)), dtype)
    w = jnp.asarray(rng.normal(size=(k_dim, n_out)) / 16, dtype)
    got = gemv_pallas(x, w, interpret=True, **tiles)
    assert got.shape == (rows, n_out) and got.dtype == dtype
    assert_close("gemv", got, np.asarray(x, np.float64) @ np.asarray(w, np.float64),
                 1e-5 if dtype == jnp.float32 else 1e-2)


def test_default_tiles_split_k_to_fill_the_gpu():
    """The default splits K into a divisor of its blocks that brings the programs near 528 (4 per SM of 132)
    without passing it, and leaves a wide weight unsplit; every default tiles its shape."""
    assert default_tiles(5632, 2048) == dict(block_n=128, block_k=128, splits=22)  # 16 columns x 22 = 352 programs
    assert default_tiles(8192, 2048)["splits"] == 32  # 512 programs
    assert default_tiles(2048, 151936)["splits"] == 1  # 1187 column blocks already
    for k_dim, n_out in [(2048, 11264), (2048, 12352), (4096, 2048), (2048, 2560), (2048, 10304)]:
        t = default_tiles(k_dim, n_out)
        assert supported(4, k_dim, n_out, t["block_n"], t["block_k"], t["splits"])
        assert n_out // t["block_n"] * t["splits"] <= 528 or t["splits"] == 1


def test_gemv_refuses_what_it_cannot_tile():
    x = jnp.zeros((MAX_ROWS + 1, 256), jnp.float32)
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv_pallas(x, jnp.zeros((256, 128), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="do not tile"):
        gemv_pallas(x[:2], jnp.zeros((256, 128), jnp.float32), block_k=128, splits=3, interpret=True)


@pytest.mark.parametrize("splits", [1, 4])
def test_gemv_lowers_for_h200(splits):
    """The kernel at a qwen3_next down projection's K (5632 = 44 blocks of 128) and 4 rows lowers to one Triton
    kernel for the H200, unsplit and split."""
    x = jnp.zeros((4, 5632), jnp.bfloat16)
    w = jnp.zeros((5632, 512), jnp.bfloat16)
    lower_for_h200(lambda x, w: gemv_pallas(x, w, block_n=128, block_k=128, splits=splits), x, w,
                   kernels=[rf"gemv_bn128_bk128_s{splits}"])


def test_linear_runs_decode_rows_as_the_gemv_when_switched_on(monkeypatch):
    """`quant.linear` with `DECODE_GEMV` on: a 4-row projection of a weight shape with measured tiles goes through
    the kernel with them (interpreted here) and gives XLA's product; 17 rows (past one tile) and a shape without
    tiles stay XLA's. Checked to fail with the switch ignored (the kernel is never called)."""
    from jhybrid.models import quant
    from pallas_kernels.decode_linear import gemv

    calls = []
    real = gemv.gemv_pallas
    monkeypatch.setattr(gemv, "gemv_pallas", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    monkeypatch.setattr(quant, "DECODE_GEMV", True)
    monkeypatch.setattr(quant, "GEMV_ON_CPU", True)
    monkeypatch.setitem(gemv.MEASURED_TILES, (1024, 1024), dict(block_n=256, block_k=128, splits=2))
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.normal(size=(1024, 1024)) / 32, jnp.float32)
    for rows in (4, 17):
        x = jnp.asarray(rng.normal(size=(rows, 1024)), jnp.float32)
        assert_close(f"{rows} rows", quant.linear(x, w), np.asarray(x, np.float64) @ np.asarray(w, np.float64), 1e-5)
    quant.linear(jnp.ones((4, 256), jnp.float32), jnp.ones((256, 256), jnp.float32))  # no measured tiles
    assert calls == [(4, 1024)]


def test_gemv_benchmark_runs_on_the_cpu(tmp_path):
    """`benchmarks/gemv.py --tiny` (the script the H200 runs, on a tiny model's shapes with the kernel interpreted):
    each shape's XLA and read timings, and kernel rows that were checked against XLA's product before timing (a
    tile that gave a wrong product would be listed as failed, not timed)."""
    import json

    from benchmarks import gemv

    out = tmp_path / "gemv.json"
    gemv.main(["--tiny", "--reps", "1", "--only", "64x512", "--json", str(out)])
    (row,) = json.loads(out.read_text())["shapes"]
    assert (row["k"], row["n"]) == (64, 512) and row["xla"]["us"] > 0 and row["read"]["us"] > 0
    assert row["pallas_best"] is not None and row["pallas_best"]["rel_err"] < 2e-2
    assert not row["pallas_failed"]
