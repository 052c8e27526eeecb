"""`benchmarks/h200_aot.py`: the kernel count of a compiled program, and (where the CUDA compile environment is
installed) every Pallas kernel compiled for the H200 through to its shared-memory check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.h200_aot import count_kernels, largest_outputs, parse_ptxas, written_by_kind
from benchmarks.head_dims import KERNELS

ROOT = Path(__file__).resolve().parents[1]

# A hand-written optimized HLO: the entry launches a fusion and a GEMM custom call, runs a loop of known trip count
# 3 whose body launches two fusions, and a conditional whose branches launch 1 and 2 kernels; a command buffer
# (`call`) holds one more fusion. Bookkeeping (parameters, tuples, get-tuple-element, bitcasts) launches nothing.
HLO = """\
HloModule jit_f, is_scheduled=true

%fused_add (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %add.0 = f32[4]{0} add(%p0, %p0)
}

%fused_red (p0: f32[4,8]) -> f32[4] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %c = f32[] constant(0)
  ROOT %r = f32[4]{0} reduce(%p0, %c), dimensions={1}, to_apply=%fused_add
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %f1 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_add
  %f2 = s32[] fusion(%i), kind=kLoop, calls=%fused_add
  ROOT %out = (s32[], f32[4]{0}) tuple(%f2, %f1)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  ROOT %lt = pred[] get-tuple-element(%t), index=0
}

%small (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %a = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_add
}

%large (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %a = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_add
  ROOT %b = f32[4]{0} fusion(%a), kind=kInput, calls=%fused_red
}

%command_buffer (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %c = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_add
}

ENTRY %main.1 (a: f32[4,8], b: (f32[4], /*index=1*/s32[])) -> (f32[4], f32[4]) {
  %a = f32[4,8]{1,0} parameter(0)
  %b = (f32[4]{0}, /*index=1*/s32[]) parameter(1)
  %r = f32[4]{0} fusion(%a), kind=kInput, calls=%fused_red
  %g = (f32[4,4]{1,0}, s8[0]{0}) custom-call(%a, %a), custom_call_target="__cublas$gemm"
  %init = (s32[], f32[4]{0}) tuple(%r, %r)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %y = f32[4]{0} get-tuple-element(%w), index=1
  %p = pred[] constant(true)
  %k = f32[4]{0} conditional(%p, %y, %y), true_computation=%small, false_computation=%large
  %cb = f32[4]{0} call(%k), to_apply=%command_buffer
  ROOT %o = (f32[4]{0}, f32[4]{0}) tuple(%k, %cb)
}
"""


def test_count_kernels_walks_loops_conditionals_and_command_buffers():
    # entry: 1 reduction fusion + 1 GEMM; loop: 2 fusions x 3 trips; conditional: itself + its smaller branch (1)
    # or its larger (2); command buffer: 1. The expected totals are counted by hand from the text above.
    # (Checked to fail: with trip counts ignored, and with a command buffer counted as one launch of its own.)
    low, high = count_kernels(HLO, "min"), count_kernels(HLO, "max")
    assert low["total"] == 1 + 1 + 6 + 1 + 1 + 1 == 11
    assert high["total"] == 12
    assert low["by_kind"] == {"loop fusion": 8, "reduction fusion": 1, "gemm (cuBLAS)": 1, "conditional": 1}
    assert high["by_kind"]["reduction fusion"] == 2


def test_largest_outputs_sums_a_tuples_elements_in_the_entry_only():
    """`largest_outputs` on the hand-written HLO: the entry's fusion and custom call by the bytes their outputs take
    (the GEMM's tuple: 4 x 4 f32 + an empty s8 = 64 bytes; the reduction 16), largest first; the loop body's fusions
    are not the entry's; a tuple of two non-empty arrays counts both. Checked to fail with a tuple's elements after
    the first dropped."""
    got = largest_outputs(HLO)
    assert [(name, round(mb * 1e6)) for name, mb, _ in got] == [("%g", 64), ("%r", 16)]
    two = HLO.replace("(f32[4,4]{1,0}, s8[0]{0}) custom-call", "(f32[4,4]{1,0}, bf16[8]{0}) custom-call")
    assert round(largest_outputs(two)[0][1] * 1e6) == 64 + 16


def test_written_by_kind_sums_the_entrys_outputs_per_kind():
    """The same entry's bytes written, by kind: the cuBLAS GEMM's 64 and the reduction fusion's 16 (the loop body's
    and the command buffer's fusions are not the entry's). Checked to fail with the names' "%" left on one side."""
    got = {kind: round(gb * 1e9) for kind, gb in written_by_kind(HLO).items()}
    assert got == {"gemm (cuBLAS)": 64, "reduction fusion": 16}


# `ptxas -v` as XLA logs it (lines of its own log prefix between; two functions, the second one spilling)
PTXAS_LOG = """\
I1205 11:00:01.7 subprocess_compilation.cc:313] ptxas /tmp/a -o /tmp/b -arch=sm_90a --warn-on-spills -v
ptxas info    : Compiling entry function 'loop_convert_fusion' for 'sm_90a'
ptxas info    : Function properties for loop_convert_fusion
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers
I1205 11:00:04.5 subprocess_compilation.cc:349] ptxas warning : Registers are spilled to local memory in function \
'mamba2_chunk_fused_c64_bv32_w4_s2', 1892 bytes spill stores, 1972 bytes spill loads
ptxas info    : Compiling entry function 'mamba2_chunk_fused_c64_bv32_w4_s2' for 'sm_90a'
ptxas info    : Function properties for mamba2_chunk_fused_c64_bv32_w4_s2
    1608 bytes stack frame, 1892 bytes spill stores, 1972 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 1608 bytes cumulative stack size
"""


def test_parse_ptxas_reads_each_functions_registers_and_spills():
    """Registers and spill bytes per function from ptxas's report (the warning line's figures are not a second
    function). Checked to fail with the stores' and loads' groups swapped."""
    assert parse_ptxas(PTXAS_LOG) == {
        "loop_convert_fusion": dict(registers=10, spill_stores=0, spill_loads=0),
        "mamba2_chunk_fused_c64_bv32_w4_s2": dict(registers=255, spill_stores=1892, spill_loads=1972),
    }


@pytest.mark.slow
def _h200_python() -> tuple[Path, dict]:
    """The H200 compile environment's python and its environment; skips without it, unless
    `JHYBRID_REQUIRE_H200_AOT=1` (CI) makes that a failure."""
    python = ROOT / ".venv-h200" / "bin" / "python"
    if not python.exists():
        if os.environ.get("JHYBRID_REQUIRE_H200_AOT") == "1":
            pytest.fail(f"{python} is missing: the H200 compile environment was not installed")
        pytest.skip(f"no H200 compile environment ({python}); see benchmarks/h200_aot.py")
    return python, dict(os.environ, JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", PYTHONPATH=str(ROOT), JAX_PLATFORMS="")


def test_pallas_kernels_compile_for_the_h200():
    """Every Pallas kernel of `benchmarks.head_dims` at head dims 16, 128 and 256, bf16 and fp32, compiled for the
    H200 by XLA (no GPU: a compile-only target): a configuration whose tiles overflow the H200's shared memory
    fails here. Needs the CUDA compile environment (`benchmarks/h200_aot.py` says how; `.ci/run` makes it in
    `.venv-h200`): without it the test skips, unless `JHYBRID_REQUIRE_H200_AOT=1` (CI) makes that a failure.
    (Checked to fail: with the chunked Gated DeltaNet kernel's one-stage pipeline at K = 256 taken out, its d=256
    cases ask for 332,296 B (bf16) and 233,732 B (fp32) of shared memory against 232,448: the figures session 26
    first met on the GPU.)"""
    python, env = _h200_python()
    out = subprocess.run([str(python), "-m", "benchmarks.h200_aot", "fit", "--dims", "16,128,256"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=1200)
    cases = 3 * 2 * len(KERNELS)  # head dims x dtypes x kernels
    assert out.returncode == 0 and f"{cases} of {cases} cases compiled for the H200" in out.stdout, (
        out.stdout[-4000:] + out.stderr[-4000:])


def test_launch_floor_chains_launch_one_kernel_a_link():
    """`benchmarks.launch_floor` times chains of N dependent kernels and reads the slope as one kernel's cost: each
    chain, compiled for the H200, must launch exactly N kernels (XLA fusing two links would make the slope half a
    kernel's). Same environment rule as above. (Checked to fail: with the `optimization_barrier` between the links
    taken out, XLA fuses the 8-link loop and norm chains into one kernel each.)"""
    python, env = _h200_python()
    out = subprocess.run([str(python), "-m", "benchmarks.launch_floor", "--h200-compile", "--kernels", "1,8"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert out.stdout.count("N=8      8 kernels") == 3, out.stdout
