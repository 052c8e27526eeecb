"""The step-program cache (jhybrid/engine/program_cache.py): its key is the same in every process for the same
program and changes with what a trace reads; a stored program loads and computes what it computed; a broken file is
a miss. (The runner uses the cache on the GPU only; `benchmarks/program_cache_check.py` runs it end to end there.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid.engine import program_cache, sampling
from jhybrid.engine.program_cache import ProgramCache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_KEY_SCRIPT = """
import json, sys
from jhybrid import LLM
from jhybrid.engine.program_cache import ProgramCache
llm = LLM(sys.argv[1], max_num_seqs=2, max_model_len=64)
runner = llm.engine.runner
runner.program_cache = ProgramCache(sys.argv[2])
print(json.dumps([runner._cache_key(key) for key in [(True, 4, 4), (False, 64, 4), (False, 64, 4, True)]]))
"""


def _args():
    return (jnp.ones((4, 8), jnp.float32), {"s": jnp.zeros((3,), jnp.int32)})


@pytest.mark.slow  # two subprocesses
def test_key_is_the_same_in_another_process(tmp_path):
    """Two fresh processes (each with its own hash seed) give the bundled model's step programs the same keys,
    and different programs different keys. Failed before sets were written in sorted order (a frozenset
    constant of config_fields printed in the process's hash order)."""
    from jhybrid.assets import default_model_path

    keys = []
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", _KEY_SCRIPT, default_model_path(), str(tmp_path)], cwd=ROOT,
                             env=dict(os.environ, PYTHONHASHSEED=seed), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        keys.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert keys[0] == keys[1]
    assert len(set(keys[0])) == 3


def test_key_changes_with_what_a_trace_reads(tmp_path, monkeypatch):
    """A module switch set at run time, a JHYBRID_* variable, the static part and an argument's shape or dtype each
    change the key (each fails if its part is left out of the key)."""
    base = ProgramCache(str(tmp_path)).key(("p",), _args())
    assert ProgramCache(str(tmp_path)).key(("p",), _args()) == base
    assert ProgramCache(str(tmp_path)).key(("q",), _args()) != base
    x, tree = _args()
    assert ProgramCache(str(tmp_path)).key(("p",), (x[:2], tree)) != base
    assert ProgramCache(str(tmp_path)).key(("p",), (x.astype(jnp.bfloat16), tree)) != base
    monkeypatch.setattr(sampling, "TOP_K_TOP_P_IMPL", "pallas" if sampling.TOP_K_TOP_P_IMPL != "pallas" else "xla")
    switched = ProgramCache(str(tmp_path)).key(("p",), _args())
    assert switched != base
    monkeypatch.setenv("JHYBRID_SOMETHING", "1")
    assert ProgramCache(str(tmp_path)).key(("p",), _args()) not in (base, switched)


def test_a_stored_program_loads_and_computes_the_same(tmp_path, caplog):
    """Store, load (a new ProgramCache on the folder), run: the same outputs; a truncated file is a miss with a
    warning, not an error."""
    f = jax.jit(lambda x, t: (jnp.tanh(x) @ x.T + t["s"].sum(), t["s"] + 1))
    args = (jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)), jnp.float32), {"s": jnp.arange(3)})
    compiled = f.lower(*args).compile()
    cache = ProgramCache(str(tmp_path))
    key = cache.key(("f",), args)
    assert cache.load(key) is None and cache.misses == 1
    cache.store(key, compiled)
    again = ProgramCache(str(tmp_path))
    loaded = again.load(key)
    assert loaded is not None and again.hits == 1
    for got, want in zip(jax.tree.leaves(loaded(*args)), jax.tree.leaves(compiled(*args))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    path = os.path.join(str(tmp_path), f"{key}.exec")
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)
    broken = ProgramCache(str(tmp_path))
    assert broken.load(key) is None and broken.misses == 1
    assert "does not load" in caplog.text


@pytest.mark.parametrize("backend,on", [("cpu", False), ("gpu", True)])
def test_the_runner_uses_it_on_the_gpu_only(tiny, tmp_path, monkeypatch, backend, on):
    """With `enable_compilation_cache`'s folder set, a new engine's runner has the cache on the GPU and not on the
    CPU (fails if the backend check is dropped, or if the runner ignores the folder)."""
    from jhybrid.engine import compilation
    from jhybrid.engine.llm_engine import LLMEngine

    monkeypatch.setattr(compilation, "program_cache_dir", str(tmp_path / "programs"))
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    engine = LLMEngine(tiny[1], dtype=None, max_num_seqs=2, max_model_len=64)
    assert (engine.runner.program_cache is not None) == on
