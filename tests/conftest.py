"""Shared pytest setup: CPU-only by default; torch (a test dependency) kept to two threads.

Most of the suite's time is XLA compiling step programs, and a compiled program is shared by every engine of
the same model config and shapes in the process. So the tiny Qwen3.5 hybrid that the engine, host-tier and
offload tests run is built once per session (`tiny`), and their engines share one shape set (`ENGINE`) where
a test needs no other (the per-family tests likewise share `FAMILY_ENGINE`); `alone` runs each of `prompts_1_to_300()` by itself once, the reference those tests
compare batched, preempted and swapped runs with.

Across processes (the two xdist workers, and the servers, engine processes and tensor-parallel workers the
tests start) programs are shared through JAX's persistent compilation cache, in one folder per test run
(`pytest_configure`; the environment variables reach the subprocesses).

Tiers: `pytest -m "not slow"` leaves out the tests marked `slow` (every family beyond one of each layer kind,
the subprocess runs, the kernel variants beyond the default one, ...); the README's command runs everything.
"""

import os
import tempfile
import uuid

import numpy as np
import pytest

try:
    import torch
except ImportError:  # torch is only needed by the HF-reference tests
    torch = None

if torch is not None:
    torch.set_num_threads(2)

# XLA:CPU compiles the tests' many small programs faster unoptimised (LLVM's expensive passes off); the tiny models
# run fast enough either way. Set before JAX makes its CPU backend; the subprocesses the tests start inherit it.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def pytest_configure(config):
    """One persistent compilation cache per test run, shared by its xdist workers and their subprocesses; fast
    unoptimised XLA:CPU compiles (`FAST_COMPILE_FLAGS`; JHYBRID_TEST_OPTIMIZED=1 keeps XLA's defaults); the heap
    not frozen per engine (`JHYBRID_GC_FREEZE=0`)."""
    if os.environ.get("JHYBRID_TEST_OPTIMIZED") != "1" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()
    run = getattr(config, "workerinput", {}).get("testrunuid") or os.environ.get("JHYBRID_TEST_RUN") or uuid.uuid4().hex
    os.environ["JHYBRID_TEST_RUN"] = run
    # no full collection and freeze per engine built (jhybrid/engine/heap.py; tests/test_heap.py turns it back on)
    os.environ.setdefault("JHYBRID_GC_FREEZE", "0")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"jhybrid-test-jax-cache-{run}")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


GREEDY = dict(temperature=0.0, ignore_eos=True)
# 4 running sequences of up to 310 tokens need up to 80 blocks of 16: 45 force preemption; 128-token steps
ENGINE = dict(dtype=None, max_num_seqs=4, max_model_len=320, num_kv_blocks=45, max_num_batched_tokens=128)
# the engine of the family tests (test_model_parity.py, test_families.py, test_slot_reuse.py): 3 rows, 96
# tokens, 32-token steps (prefills are chunked and interleaved with decodes), 10 blocks of 16 (two long
# sequences do not fit: preemption, while a slot may be free)
FAMILY_ENGINE = dict(dtype=None, max_num_seqs=3, max_model_len=96, num_kv_blocks=11, max_num_batched_tokens=32)


def prompts_1_to_300(n=16, vocab=128):
    rng = np.random.default_rng(0)
    lengths = np.linspace(1, 300, n).astype(int)
    return [rng.integers(0, vocab, size=int(length)).tolist() for length in lengths]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A tiny random Qwen3.5 hybrid (3 GDN : 1 full) with a 512-token context, and its HF model."""
    from jhybrid import LLM
    from tests.hf_models import make_qwen3_5

    path = tmp_path_factory.mktemp("q35")
    hf_model = make_qwen3_5(path, seed=11, max_position_embeddings=512)
    return hf_model, LLM(path, dtype=None, max_num_seqs=1, max_model_len=16).model  # the loaded model


@pytest.fixture(scope="session")
def alone(tiny):
    """`prompts_1_to_300()`, 10 greedy tokens each, each run by itself on an `ENGINE` engine (no preemption)."""
    from jhybrid import LLM, SamplingParams

    llm = LLM(tiny[1], **ENGINE)
    outs = [llm.generate([p], SamplingParams(max_tokens=10, **GREEDY))[0] for p in prompts_1_to_300()]
    assert llm.engine.num_preemptions == 0
    return [o.token_ids for o in outs]


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped unless JAX sees a GPU."""
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_tests:
        import jax

        if not any(d.platform == "gpu" for d in jax.devices()):
            for item in gpu_tests:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def _num_memory_maps() -> int | None:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return None


@pytest.fixture(autouse=True, scope="module")
def _bounded_compiled_programs():
    """Keeps compiled programs across modules (later modules reuse them) until they hold a third of the kernel's
    memory-map limit: each XLA CPU executable maps ~140 regions, and past `vm.max_map_count` (65530 by default)
    the next compile aborts the process. Then drops JAX's caches after the module."""
    yield
    maps = _num_memory_maps()
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
    except (OSError, ValueError):
        limit = 65530
    if maps is not None and maps > limit // 3:
        import gc

        import jax

        jax.clear_caches()
        gc.unfreeze()  # engines freeze the heap (jhybrid/engine/heap.py): let the pass see dropped engines too
        gc.collect()
