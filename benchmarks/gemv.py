"""A decode step's projections as GEMVs, per weight shape of the `benchmarks.floors` models: how fast each way of
running `x @ w` at a few rows streams the weight, beside reading the same bytes (issue 20's batch-1 rows).

    PYTHONPATH=. python3 -m benchmarks.gemv [--rows 4] [--gib 1] [--quick] [--json out.json]
    PYTHONPATH=. python -m benchmarks.gemv --tiny          # CPU smoke test (small shapes, interpreted kernels)

Each shape gets enough distinct weights (`--gib` in all) that none is still in L2 (50 MB on the H200) when it is
read again; one jitted call runs the projection over each in turn, as a step runs its layers. Timed: the calls of
`--reps` issued back to back, then the device waited for (the device's time; a call's launch hides behind the
previous one). Per shape, microseconds per weight and the bandwidth that gives (weight bytes / time):

- `xla`: `jhybrid.models.quant.linear`, the engine's projection (XLA's GEMM, rows padded as it pads them);
- `pallas`: `pallas_kernels.decode_linear.gemv_pallas` at its default tiles, and the best of a sweep of tiles,
  checked against `xla`'s output first (relative error);
- `read`: a jnp sum of the weight (the bytes read once, nothing else: the floor at this size, one kernel a weight);
- `torch mm` / `torch copy`: cuBLAS's `x @ w` and a `copy_` (bytes counted read + write) over the same number of
  weights, captured in a CUDA graph (where torch has CUDA).

The summary prices a token of each model: its projections' weights (and the LM head) times each way's time per
weight, against the same bytes at the `read` rate and at the 4 GiB read bandwidth of `benchmarks.floors`.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import math
import time

import numpy as np


def log(*a):
    print(*a, flush=True)


def model_shapes(tiny: bool) -> dict[str, collections.Counter]:
    """Per `benchmarks.floors` model, its streamed 2-D weights `(K, N)` with how many a token reads: the packed
    projections of every layer and the LM head (not the embedding table, of which a token reads one row; not the
    routed experts, `benchmarks.moe`'s)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.floors import hf_config
    from jhybrid.config import ModelConfig
    from jhybrid.models.params import flatten_shapes, pack_params, param_shapes, unflatten

    out = {}
    for name in ("qwen3_next", "nemotron_h", "minimax"):
        cfg = ModelConfig.from_hf(hf_config(name, tiny))
        flat = {k: jax.ShapeDtypeStruct(s, jnp.bfloat16) for k, s in flatten_shapes(param_shapes(cfg)).items()}
        packed = jax.eval_shape(lambda f: pack_params(unflatten(f, cfg)), flat)
        counts = collections.Counter()
        for path, leaf in jax.tree_util.tree_leaves_with_path(packed):
            key = jax.tree_util.keystr(path)
            if len(leaf.shape) == 2 and min(leaf.shape) >= (32 if tiny else 256) and "embed" not in key:
                counts[tuple(leaf.shape)] += 1
        out[name] = counts
    return out


def sweep_tiles(k_dim: int, n_out: int, quick: bool) -> list[dict]:
    """Tile settings of `gemv_pallas` to try for a `[K, N]` weight (those that tile it)."""
    from pallas_kernels.decode_linear.gemv import supported

    shapes = [(128, 128), (32, 32)] if quick else [(64, 128), (128, 128), (256, 64), (256, 128)]
    targets = [528] if quick else [264, 528, 1056]
    stages = [3]
    seen, out = set(), []
    for (bn, bk), target, ns in itertools.product(shapes, targets, stages):
        if n_out % bn or k_dim % bk:
            continue
        blocks = k_dim // bk
        splits = max(s for s in range(1, blocks + 1) if blocks % s == 0 and (s == 1 or n_out // bn * s <= target))
        tiles = dict(block_n=bn, block_k=bk, splits=splits, num_stages=ns)
        if supported(4, k_dim, n_out, bn, bk, splits) and tuple(tiles.values()) not in seen:
            seen.add(tuple(tiles.values()))
            out.append(tiles)
    return out


def time_calls(f, args, reps: int) -> float:
    """Seconds per call of `f(*args)`: `reps` calls issued back to back, the last waited for (after two warm ones)."""
    import jax

    for _ in range(2):
        jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def torch_times(k_dim: int, n_out: int, rows: int, copies: int, reps: int) -> dict:
    """cuBLAS `x @ w` and `copy_` over `copies` weights, each captured in a CUDA graph: seconds per weight."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    ws = [torch.randn(k_dim, n_out, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    dst = [torch.empty_like(w) for w in ws]
    x = torch.randn(rows, k_dim, device="cuda", dtype=torch.bfloat16)
    out = {}
    for name, op in (("torch_mm", lambda i: x @ ws[i]), ("torch_copy", lambda i: dst[i].copy_(ws[i]))):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(copies):
                op(i)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(copies):
                op(i)
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - t0) / reps / copies
    del ws, dst
    torch.cuda.empty_cache()
    return out


def bench_shape(k_dim: int, n_out: int, rows: int, total_bytes: float, reps: int, quick: bool,
                interpret: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from jhybrid.models.quant import linear
    from pallas_kernels.decode_linear.gemv import default_tiles, gemv_pallas

    nbytes = 2 * k_dim * n_out
    copies = max(1, math.ceil(total_bytes / nbytes))
    key = jax.random.key(k_dim * 7 + n_out)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (k_dim, n_out), jnp.bfloat16) * 0.02 for i in range(copies)]
    x = jax.random.normal(jax.random.fold_in(key, 1 << 20), (rows, k_dim), jnp.bfloat16)
    over = lambda op: jax.jit(lambda x, ws: [op(x, w) for w in ws])  # noqa: E731
    row = dict(k=k_dim, n=n_out, rows=rows, mbytes=nbytes / 1e6, copies=copies)
    per = lambda seconds: dict(us=seconds * 1e6, tbps=nbytes / seconds / 1e12)  # noqa: E731
    want = over(linear)(x, ws[:1])[0].astype(jnp.float32)
    row["xla"] = per(time_calls(over(linear), (x, ws), reps) / copies)
    row["read"] = per(time_calls(over(lambda x, w: jnp.sum(w, dtype=jnp.float32)), (x, ws), reps) / copies)

    def run_tiles(tiles: dict) -> dict | None:
        op = lambda x, w: gemv_pallas(x, w, interpret=interpret, **tiles)  # noqa: E731
        try:
            got = over(op)(x, ws[:1])[0].astype(jnp.float32)
        except Exception as e:  # noqa: BLE001 (a tile that does not compile is a row of the table, not a crash)
            return dict(tiles=tiles, error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
        err = float(jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-30))
        if err > 2e-2:
            return dict(tiles=tiles, error=f"relative error {err:.2e}")
        return dict(tiles=tiles, rel_err=err, **per(time_calls(over(op), (x, ws), reps) / copies))

    row["pallas_default"] = run_tiles(dict(default_tiles(k_dim, n_out)))
    tried = [run_tiles(t) for t in sweep_tiles(k_dim, n_out, quick)]
    ok = [t for t in tried if "us" in t]
    row["pallas_best"] = min(ok, key=lambda t: t["us"]) if ok else None
    row["pallas_failed"] = [t for t in tried if "error" in t]
    row["pallas_sweep"] = tried
    if jax.default_backend() == "gpu":
        row.update({k: per(v) if k == "torch_mm" else dict(us=v * 1e6, tbps=2 * nbytes / v / 1e12)
                    for k, v in torch_times(k_dim, n_out, rows, copies, reps).items()})
    del ws
    return row


def fmt(cell) -> str:
    return f"{cell['us']:.1f} us {cell['tbps']:.2f}" if cell and "us" in cell else "-"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4, help="rows of x (the engine's decode bucket at batch 1: 4)")
    p.add_argument("--gib", type=float, default=1.0, help="weights per shape, in all (distinct copies past L2)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="one tile setting beside the default")
    p.add_argument("--only", default="", help="shapes KxN,KxN (default: every shape of the models)")
    p.add_argument("--tiny", action="store_true", help="tiny configs, interpreted kernels (CPU smoke test)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import jax

    from benchmarks.floors import read_bandwidth

    models = model_shapes(a.tiny)
    shapes = sorted({s for counts in models.values() for s in counts}, key=lambda s: -s[0] * s[1])
    if a.only:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.only.split(",")]
    total = (1 << 20) if a.tiny else a.gib * 2**30
    bandwidth = read_bandwidth(a.tiny)
    log(f"{jax.devices()[0].device_kind}: read bandwidth (jnp sum over 4 GiB) {bandwidth / 1e12:.2f} TB/s; "
        f"{len(shapes)} shapes, {a.rows} rows")
    rows = []
    for i, (k_dim, n_out) in enumerate(shapes):
        t0 = time.perf_counter()
        r = bench_shape(k_dim, n_out, a.rows, total, a.reps, a.quick or a.tiny, interpret=a.tiny)
        rows.append(r)
        best = r["pallas_best"]
        log(f"[{i + 1}/{len(shapes)}] {k_dim}x{n_out} ({r['mbytes']:.1f} MB x {r['copies']}): xla {fmt(r['xla'])} | "
            f"read {fmt(r['read'])} | pallas default {fmt(r['pallas_default'])} | best {fmt(best)} "
            f"{best['tiles'] if best else ''} | torch mm {fmt(r.get('torch_mm'))} | copy {fmt(r.get('torch_copy'))} "
            f"| {len(r['pallas_failed'])} tiles failed ({time.perf_counter() - t0:.0f} s)")
        write(a.json, dict(device=jax.devices()[0].device_kind, read_bandwidth=bandwidth, rows_x=a.rows, shapes=rows))
    log("\n| shape K x N | MB | xla us (TB/s) | pallas default | pallas best (tiles) | read (jnp sum) | torch mm | "
        "torch copy (r+w) |")
    log("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        best = r["pallas_best"]
        tiles = "/".join(str(v) for v in best["tiles"].values()) if best else ""
        log(f"| {r['k']} x {r['n']} | {r['mbytes']:.1f} | {fmt(r['xla'])} | {fmt(r['pallas_default'])} | "
            f"{fmt(best)} ({tiles}) | {fmt(r['read'])} | {fmt(r.get('torch_mm'))} | {fmt(r.get('torch_copy'))} |")
    by_shape = {(r["k"], r["n"]): r for r in rows}
    summary = {}
    log("\nPer token, the projections and LM head of each model (ms): each way's time per weight x weights a token "
        "reads")
    log("| model | MB | at 4 GiB read bw | read (jnp sum) | xla | pallas best | torch mm |")
    log("|---|---:|---:|---:|---:|---:|---:|")
    for name, counts in models.items():
        if not all(s in by_shape for s in counts):
            continue
        mbytes = sum(by_shape[s]["mbytes"] * n for s, n in counts.items())
        cost = lambda key: sum((by_shape[s].get(key) or {}).get("us", math.nan) * n  # noqa: E731
                               for s, n in counts.items()) / 1e3
        summary[name] = dict(mbytes=mbytes, floor_ms=mbytes * 1e6 / bandwidth * 1e3, read_ms=cost("read"),
                             xla_ms=cost("xla"), pallas_ms=cost("pallas_best"), torch_mm_ms=cost("torch_mm"))
        s = summary[name]
        log(f"| {name} | {mbytes:.0f} | {s['floor_ms']:.3f} | {s['read_ms']:.3f} | {s['xla_ms']:.3f} | "
            f"{s['pallas_ms']:.3f} | {s['torch_mm_ms']:.3f} |")
    write(a.json, dict(device=jax.devices()[0].device_kind, read_bandwidth=bandwidth, rows_x=a.rows, shapes=rows,
                       models={k: dict(v) for k, v in summary.items()},
                       weights={k: {f"{s[0]}x{s[1]}": n for s, n in c.items()} for k, c in models.items()}))


def write(path: str | None, data: dict) -> None:
    """`data` as JSON to `path` (rewritten after each shape: a run cut short keeps its rows)."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
