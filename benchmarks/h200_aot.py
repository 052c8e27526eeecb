"""The engine's step programs and the Pallas kernels compiled for the H200 on a machine without a GPU (issue 20).

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 .venv-h200/bin/python -m benchmarks.h200_aot kernels \
        [--models qwen3_next,nemotron_h,minimax] [--rows 1,4] [--steps 1] [--hlo DIR] [--json out.json] \
        [--set MODULE.NAME=VALUE]... [--prefill 8192]
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 .venv-h200/bin/python -m benchmarks.h200_aot fit [--json out.json]

XLA compiles for a GPU it does not have when it is given the GPU's description (a `GpuTargetConfigProto`,
`H200_TARGET` below: the figures of XLA's own H200 spec file) through a compile-only PJRT topology
(`jax.experimental.topologies`). The compile is the one the H200 would run, autotuning aside (no device to time
GEMM configurations on, XLA takes its defaults): the same fusion passes, the same Triton compilation of the Pallas
kernels, the same shared-memory check at the end. What this answers without a GPU:

- `kernels`: the kernels one engine step launches (the decode step of `benchmarks.floors`' models at batch 1 and 4
  by default, through `ModelRunner`'s own `engine_step`), sorted by kind: GEMMs (cuBLAS), Pallas/Triton kernels,
  XLA fusions by their root (elementwise "loop", reductions "input", ...), copies, and the loops' bodies times
  their trip counts. `--steps N` compiles the multi-step program of N decode steps instead and divides by N.
  `--prefill T` adds the one-row prefill step of T tokens and lists the fusions that write the most bytes.
  `--set` changes a module switch first (e.g. `pallas_kernels.gated_delta_rule.FUSED_DECODE=True`), as
  `benchmarks.device_loop --variant` does on the GPU, so a change's kernel count is known before device time is
  spent on timing it.
- `fit`: every Pallas kernel at every head dimension of `benchmarks.head_dims` compiled through to a cubin: a
  configuration whose tiles do not fit the H200's shared memory fails here (XLA's "Shared memory size limit
  exceeded") as it would at run time on the device.

The environment: a virtual environment of its own with the CUDA plugin (the plugin, ptxas and libdevice; no
driver, no cuDNN; `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1` skips the plugin's check for the libraries a device run
would need). `.ci/run` makes it; by hand:

    python3.12 -m venv .venv-h200 && .venv-h200/bin/pip install -e ".[h200-aot]"

Kernel counts are launches, not times: a small fusion costs the H200 a few microseconds whatever it does, so at
batch 1 they are most of the gap between a step and its bytes floor (benchmarks/RESULTS.md, session 28).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import json
import math
import os
import re
import sys
import time
from unittest import mock

from benchmarks.switches import add_set_argument, apply_sets

# the H200 as XLA describes it (xla/backends/gpu/target_config/specs/h200.txtpb: its hardware figures; the rate
# tables, which only XLA's cost models read, left out)
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 151397597184 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 feature_extension: ACCELERATED_FEATURES }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
  thread_dim_limit_x: 1024 thread_dim_limit_y: 1024 thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation" platform_version: "Compute Capability 9.0a"
  device_address_bits: 64 pcie_bandwidth: 34359738368 ecc_enabled: true
  name: "NVIDIA H200 141GB HBM3e" driver_version: "13.0.0" runtime_version: "12.8.0"
  compile_time_toolkit_version: "12.8.0" dnn_version: "9.10.0" cub_version: "3.1.2"
  device_interconnect_info { active_links: 18 } collective_memory_granularity: 2097152
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H200 141GB HBM3e"
"""


def log(*a):
    print(*a, flush=True)


# ptxas's report of one compiled function (`ptxas -v`, logged by XLA's subprocess compilation at VLOG 3)
_PTXAS_FUNCTION = re.compile(r"Function properties for (\S+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                             r"(\d+) bytes spill loads\s*\n[^\n]*Used (\d+) registers")
# what makes XLA print that report: set before jaxlib loads (`main` does it for `fit`), one compile at a time so
# that the reports do not interleave
PTXAS_ENV = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "subprocess_compilation=3"}
PTXAS_XLA_FLAGS = "--xla_gpu_ptx_compiler_extra_flags=-v --xla_gpu_force_compilation_parallelism=1"


def parse_ptxas(text: str) -> dict[str, dict[str, int]]:
    """Per compiled function in a `ptxas -v` log: its registers a thread and spill bytes (stores, loads)."""
    return {m[1]: dict(registers=int(m[5]), spill_stores=int(m[3]), spill_loads=int(m[4]))
            for m in _PTXAS_FUNCTION.finditer(text)}


@contextlib.contextmanager
def captured_fd2():
    """Inside, whatever the process writes to file descriptor 2 (XLA's C++ log included) goes to a temporary file
    instead; yields a list that holds that text on exit."""
    import tempfile

    out: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


def gpu_choices():
    """`jax.default_backend()` reads "gpu" inside: the project's "auto" kernel and engine choices are the GPU's."""
    import jax

    return mock.patch.object(jax, "default_backend", lambda: "gpu")


@contextlib.contextmanager
def h200():
    """Inside: tracing lowers for CUDA as on an H200 (`gpu_choices`, and Pallas lowers for the H200's compute
    capability). Yields the compile-only device to put the arguments on. Nothing may run inside (only trace)."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import AbstractDevice, AbstractMesh, SingleDeviceSharding

    topology = topologies.get_topology_desc("h200", "cuda", target_config=H200_TARGET, topology="1x1x1")
    abstract = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    with gpu_choices(), jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=abstract)):
        yield SingleDeviceSharding(topology.devices[0])


def on_device(tree, sharding):
    """Every array leaf of `tree` as a `ShapeDtypeStruct` on the compile-only `sharding`."""
    import jax
    import numpy as np

    def leaf(x):
        if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return x

    return jax.tree.map(leaf, tree)


def compile_for_h200(fn, args, kwargs, sharding):
    """`fn` (a `jax.jit` function) lowered for CUDA and compiled for the H200: the `Compiled`."""
    return fn.trace(*on_device(args, sharding), **on_device(kwargs, sharding)).lower(
        lowering_platforms=("cuda",)).compile()


# ------------------------------------------------------------------------------------------------ kernel counting

# instructions that launch nothing: bookkeeping, or computations walked into (call, while, conditional)
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier",
         "partition-id", "replica-id", "add-dependency", "domain"}
_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")


def _opcode(rhs: str) -> tuple[str, str]:
    """(opcode, the rest after it) of an instruction's right-hand side `TYPE opcode(operands), attrs`."""
    i = 0
    if rhs.startswith("("):  # a tuple type: skip to its closing parenthesis
        depth = 0
        for i, c in enumerate(rhs):
            depth += c == "("
            depth -= c == ")"
            if depth == 0:
                break
    rest = rhs[i:].split(" ", 1)[1] if " " in rhs[i:] else ""
    m = re.match(r"([\w\-]+)\(", rest)
    return (m.group(1), rest) if m else ("?", rest)


def parse_hlo(text: str) -> tuple[dict[str, list[tuple[str, str, str]]], str]:
    """The optimized HLO's computations: name -> [(instruction, opcode, rest)], and the entry's name."""
    comps: dict[str, list] = {}
    entry, current = "", None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)  # headers start at the line's start, instructions are indented
        if m and not line[:1].isspace():
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            op, rest = _opcode(m.group(2))
            comps[current].append((m.group(1), op, rest))
    return comps, entry


def _called(rest: str, attr: str) -> list[str]:
    """The computations an instruction names in `attr=%c` or `attr={%c1, %c2}`."""
    m = re.search(r"\b" + attr + r"=(?:\{([^}]*)\}|%?([\w.\-]+))", rest)
    if not m:
        return []
    return [c.strip().lstrip("%") for c in (m.group(1) or m.group(2)).split(",") if c.strip()]


def _kind(op: str, rest: str, comps) -> str:
    """A launching instruction's kind for the table."""
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        target = target.group(1) if target else "?"
        if "triton" in target:
            return "pallas/triton"
        if "gemm" in target.lower() or "cublas" in target.lower():
            return "gemm (cuBLAS)"
        if "cudnn" in target.lower():
            return "cudnn"
        return f"custom-call {target}"
    if op == "fusion":
        kind = re.search(r"kind=k(\w+)", rest)
        called = _called(rest, "calls")
        body = comps.get(called[0], []) if called else []
        ops = {o for _, o, _ in body}
        if kind and kind.group(1) == "Custom":
            if "dot" in ops or "triton_gemm" in rest or "__triton_gemm" in rest:
                return "gemm (Triton fusion)"
            return "custom fusion"
        label = {"Loop": "loop fusion", "Input": "reduction fusion", "Output": "output fusion"}.get(
            kind.group(1) if kind else "", f"fusion {kind.group(1) if kind else '?'}")
        if "dynamic-update-slice" in ops or "scatter" in ops:
            label += " (in-place update)"
        return label
    return op


def count_kernels(text: str, branches: str = "min") -> dict:
    """Launches of one execution of the compiled program `text`: loops' bodies times their known trip counts
    (a loop without one counts once), a conditional's branch with the fewest launches (`branches="min"`, the
    step with no optional sampling part) or the most ("max"); command buffers (`call`) are walked into. Returns
    {total, by_kind: {kind: n}, names: [(instruction, kind, times)]}; each conditional also counts as one
    "conditional" (XLA reads its predicate back to the host before it launches the branch)."""
    comps, entry = parse_hlo(text)
    pick = min if branches == "min" else max

    def walk(comp: str, times: float, out: list) -> None:
        for name, op, rest in comps.get(comp, []):
            if op in _FREE:
                continue
            if op == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                n = int(trip.group(1)) if trip else 1
                for c in _called(rest, "condition") + _called(rest, "body"):
                    walk(c, times * n, out)
            elif op == "call":
                for c in _called(rest, "to_apply"):
                    walk(c, times, out)
            elif op == "conditional":
                options = []
                for b in _called(rest, "branch_computations") or (
                        _called(rest, "true_computation") + _called(rest, "false_computation")):
                    branch: list = []
                    walk(b, times, branch)
                    options.append(branch)
                out.append((name, "conditional", times))
                if options:
                    out.extend(pick(options, key=lambda o: sum(t for _, _, t in o)))
            else:
                out.append((name, _kind(op, rest, comps), times))

    names: list = []
    walk(entry, 1.0, names)
    by_kind: collections.Counter = collections.Counter()
    for _, kind, times in names:
        by_kind[kind] += times
    return dict(total=sum(t for _, _, t in names), by_kind=dict(by_kind.most_common()), names=names)


# ------------------------------------------------------------------------------------------------ step programs


def step_kernels(name: str, rows: int, steps: int, hlo_dir: str | None, prefill: int = 0) -> dict:
    """Compiles the engine's decode step program for model `name` (`benchmarks.floors`' shapes) at `rows` rows
    (`steps` > 1: the multi-step program of that many greedy steps) for the H200; its kernel counts. `prefill` > 0:
    instead the prefill step program of one row of that many tokens (its attention without the cuDNN part, which
    needs cuDNN at compile time), with the fusions that write the most bytes (`largest_outputs`)."""
    import jax

    from benchmarks.decode_step import random_params
    from benchmarks.floors import hf_config
    from jhybrid.cache import CacheConfig
    from jhybrid.config import ModelConfig
    from jhybrid.engine import runner as runner_mod
    from jhybrid.engine.sampling import SamplerPlan

    attention = importlib.import_module("pallas_kernels.paged_attention")  # the package (its function shares the name)

    cfg = ModelConfig.from_hf(hf_config(name, False))
    params = jax.eval_shape(lambda: random_params(cfg))
    with gpu_choices():  # the runner as on the GPU (small real caches: their shapes do not change the kernels)
        cache = CacheConfig(num_blocks=1024, block_size=16, num_slots=rows + 1)
        runner = runner_mod.ModelRunner(cfg, params, cache, max_num_seqs=rows, max_model_len=max(4096, prefill + 8),
                                        max_num_batched_tokens=max(2048, prefill))
        bucket = runner.buckets(not prefill, rows, prefill or rows)
        plan = SamplerPlan() if steps > 1 else None
        args, kwargs = runner._step_args(not prefill, bucket[1], bucket[0], False, steps, plan)
    no_cudnn = mock.patch.object(attention, "AUTO_CUDNN_PREFILL", False) if prefill else contextlib.nullcontext()
    with h200() as sharding, no_cudnn:
        t0 = time.perf_counter()
        compiled = compile_for_h200(runner_mod.engine_step, args, kwargs, sharding)
        seconds = time.perf_counter() - t0
    text = compiled.as_text()
    if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        with open(os.path.join(hlo_dir, f"{name}-{f'p{prefill}' if prefill else f'r{rows}-s{steps}'}.hlo.txt"),
                  "w") as f:
            f.write(text)
    counts, most = count_kernels(text, "min"), count_kernels(text, "max")
    per = max(steps, 1)
    return dict(model=name, rows=rows, prefill=prefill, bucket=list(bucket), steps=steps, compile_s=seconds,
                largest=largest_outputs(text) if prefill else [],
                written_gb=written_by_kind(text) if prefill else {},
                layers=cfg.num_layers, kernels=counts["total"] / per, kernels_max=most["total"] / per,
                by_kind={k: v / per for k, v in counts["by_kind"].items()},
                names=[(n, k, t / per) for n, k, t in counts["names"]])


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "f64": 8}


def largest_outputs(text: str, top: int | None = 12) -> list[tuple[str, float, str]]:
    """The entry computation's fusions and custom calls that write the most bytes (their output shapes; a tuple's
    elements summed), with XLA's `op_name` of each: `(name, MB, op_name)`, largest first. Bytes written are a lower
    bound on a kernel's traffic, and show what a step materialises (e.g. zero-filled outputs)."""
    entry = text[text.index("\nENTRY "):].split("\n}\n")[0]
    out = []
    for line in entry.split("\n"):
        m = re.match(r"\s*(%[\w.\-]+) = (.*?) (?:fusion|custom-call)\(", line)
        if not m:
            continue
        nbytes = sum(_DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
                     for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(2)))
        op = re.search(r'op_name="([^"]*)"', line)
        out.append((m.group(1), nbytes / 1e6, op.group(1) if op else ""))
    return sorted(out, key=lambda t: -t[1])[:top]  # (top None: all)


def written_by_kind(text: str) -> dict[str, float]:
    """GB that the entry computation's fusions and custom calls write (their outputs' bytes, a tuple's elements
    summed), by `_kind`; largest first. A step's kernels outside the entry (loop bodies) are not counted."""
    comps, _ = parse_hlo(text)
    sizes = {name.lstrip("%"): mb for name, mb, _ in largest_outputs(text, top=None)}
    entry = text[text.index("\nENTRY "):].split("\n}\n")[0]
    out: collections.Counter = collections.Counter()
    for line in entry.split("\n"):
        m = _INSTRUCTION.match(line)
        if m and m.group(1) in sizes:
            op, rest = _opcode(m.group(2))
            out[_kind(op, rest, comps)] += sizes[m.group(1)] / 1e3
    return dict(out.most_common())


def kernels_main(args) -> int:
    rows = []
    programs = [(r, 0) for r in (int(x) for x in args.rows.split(","))] if args.rows else []
    programs += [(1, t) for t in (int(x) for x in args.prefill.split(","))] if args.prefill else []
    for name in args.models.split(","):
        for r, tokens in programs:
            row = step_kernels(name, r, args.steps, args.hlo, prefill=tokens)
            rows.append(row)
            what = f"prefill of {tokens} tokens" if tokens else f"{r} row(s) (bucket {row['bucket']}), {args.steps} step(s) a program"
            log(f"\n{name}, {what}: {row['kernels']:.1f} kernels a step ({row['kernels'] / row['layers']:.1f} a layer "
                f"over {row['layers']} layers; {row['kernels_max']:.1f} with every sampling branch), compiled in "
                f"{row['compile_s']:.1f} s")
            for kind, n in row["by_kind"].items():
                log(f"  {n:8.1f}  {kind}")
            if row["written_gb"]:
                log("  written: " + ", ".join(f"{kind} {gb:.2f} GB" for kind, gb in row["written_gb"].items()))
            for fusion, mb, op in row["largest"]:
                log(f"  {mb:10.1f} MB written  {fusion}  {op[-90:]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(sets=args.set, rows=[{k: v for k, v in r.items() if k != "names" or args.names}
                                                for r in rows]), f, indent=1)
    return 0


# ------------------------------------------------------------------------------------------------ shared memory


def fit_main(args) -> int:
    """Every `benchmarks.head_dims` case (`impl="pallas"`) compiled for the H200; a failure is printed with its
    reason and makes the exit status 1."""
    import functools

    import jax
    import jax.numpy as jnp

    from benchmarks import head_dims

    results = []
    todo = [(name, d, dtype, fn, fargs) for d in (int(x) for x in args.dims.split(","))
            for dtype in (jnp.bfloat16, jnp.float32) for name, (fn, fargs) in head_dims.cases(d, dtype).items()]
    with h200() as sharding:
        if True:
            for name, d, dtype, fn, fargs in todo:
                if True:
                    t0 = time.perf_counter()
                    with captured_fd2() as ptxas_log:
                        try:
                            kernel = jax.jit(functools.partial(fn, impl="pallas", interpret=False))
                            text = compile_for_h200(kernel, fargs, {}, sharding).as_text()
                            status = "ok" if "triton" in text else "FAILED: no Triton kernel in the program"
                        except Exception as e:  # noqa: BLE001  the reason is the result: every case is tried
                            status = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    row = dict(kernel=name, head_dim=d, dtype=jnp.dtype(dtype).name, status=status,
                               seconds=time.perf_counter() - t0, ptxas=_pallas_functions(ptxas_log[0]))
                    results.append(row)
                    log(f"{name:18s} d={d:<4d} {row['dtype']:9s} {status}  ({row['seconds']:.1f} s){_spills(row)}")
    failed = [r for r in results if r["status"] != "ok"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    log(f"\n{len(results) - len(failed)} of {len(results)} cases compiled for the H200")
    return 1 if failed else 0


def _pallas_functions(log_text: str) -> dict[str, dict[str, int]]:
    """`parse_ptxas` without XLA's own fusions (named `*_fusion*`)."""
    return {k: v for k, v in parse_ptxas(log_text).items() if "fusion" not in k}


def _spills(row) -> str:
    """The most registers and spill bytes among a compile's Pallas kernels, as a log suffix."""
    if not row["ptxas"]:
        return ""
    regs = max(r["registers"] for r in row["ptxas"].values())
    spill = max(r["spill_stores"] for r in row["ptxas"].values())
    return f"  regs {regs}" + (f", SPILLS {spill} B" if spill else "")


def spills_main(args) -> int:
    """Registers and spill bytes (ptxas) of Mamba2's chunked-prefill kernels at a layer of `--dims` (default the
    `benchmarks.floors` NemotronH layer: Hm 64, P 64, G 8, N 128; one row of `--tokens`): the parts' simple-GLA
    kernel, and the form that reads the conv output in place, at each tuning of `--tunings`."""
    import functools

    import jax
    import jax.numpy as jnp

    from pallas_kernels.simple_gla.chunk import chunk_mamba2_pallas, chunk_simple_gla_pallas

    t, (h, p, g, n) = args.tokens, (int(x) for x in args.dims.split(","))
    f32, i32 = jnp.float32, jnp.int32
    sd = jax.ShapeDtypeStruct
    common = (sd((2,), i32), sd((4, h, n, p), f32), sd((1,), i32))  # cu_seqlens, state, slot_ids
    gates = sd((t, h), f32)
    cases = [("parts", json.loads(x)) for x in args.tunings.split(";")] + [
        ("in_place", json.loads(x)) for x in args.tunings.split(";")]
    rows = []
    with h200() as sharding:
        for form, tuning in cases:
            if form == "parts":  # `scan_dtype`: the dtype of B, C and v (`chunk_mamba2`'s), fp32 where not given
                kw = {k: v for k, v in tuning.items() if k != "scan_dtype"}
                fn = functools.partial(chunk_simple_gla_pallas, **kw)
                dt = jnp.dtype(tuning.get("scan_dtype", "float32"))
                fargs = (sd((t, g, n), dt), sd((t, g, n), dt), sd((t, h, p), dt), gates, *common)
            else:
                fn = functools.partial(chunk_mamba2_pallas, dims=(h, p, g, n), out_dtype=jnp.bfloat16, **tuning)
                cu, state, slots = common
                fargs = (sd((t, h * p + 2 * g * n), jnp.bfloat16), gates, gates, sd((h,), f32), cu, state, slots,
                         sd((t, 2 * h * p + 2 * g * n + h), jnp.bfloat16))
            with captured_fd2() as ptxas_log:
                compile_for_h200(jax.jit(fn), fargs, {}, sharding)
            for name, r in sorted(_pallas_functions(ptxas_log[0]).items()):
                rows.append(dict(form=form, tuning=tuning, kernel=name, **r))
                log(f"{form:9s} {json.dumps(tuning):40s} {name:45s} regs {r['registers']:3d}  spill stores "
                    f"{r['spill_stores']:5d} B  loads {r['spill_loads']:5d} B")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    k = sub.add_parser("kernels", help="kernels per engine step, by kind")
    k.add_argument("--models", default="qwen3_next,nemotron_h,minimax")
    k.add_argument("--rows", default="1,4", help="decode rows (comma-separated)")
    k.add_argument("--steps", type=int, default=1, help="decode steps a program (multi-step decode)")
    k.add_argument("--prefill", default="", help="also the prefill step of one row of these many tokens (comma-"
                   "separated; e.g. 8192), with the fusions that write the most bytes; --rows '' for only these")
    k.add_argument("--hlo", help="write each program's optimized HLO here")
    k.add_argument("--names", action="store_true", help="keep every kernel's name in the JSON")
    k.add_argument("--json")
    add_set_argument(k, "pallas_kernels.gated_delta_rule.FUSED_DECODE=True")
    f = sub.add_parser("fit", help="every Pallas kernel at every head dim compiled for the H200")
    f.add_argument("--dims", default="16,32,64,128,256")
    f.add_argument("--json")
    sp = sub.add_parser("spills", help="registers and spills (ptxas) of Mamba2's chunked-prefill kernels per tuning")
    sp.add_argument("--tokens", type=int, default=8192)
    sp.add_argument("--dims", default="64,64,8,128", help="Mamba2 heads, head dim, groups, state size (Nemotron-H-56B: "
                    "256,64,8,256)")
    sp.add_argument("--tunings", default='{};{"num_warps": 8};{"num_warps": 8, "block_v": 16}',
                    help="';'-separated JSON dicts of kernel keyword arguments")
    sp.add_argument("--json")
    args = ap.parse_args(argv)
    if args.command in ("fit", "spills"):  # ptxas's reports (`parse_ptxas`); jaxlib is not loaded yet
        os.environ.update(PTXAS_ENV)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {PTXAS_XLA_FLAGS}".strip()
    if args.command == "fit":
        return fit_main(args)
    if args.command == "spills":
        return spills_main(args)
    apply_sets(ap, args.set)
    return kernels_main(args)


if __name__ == "__main__":
    sys.exit(main())
