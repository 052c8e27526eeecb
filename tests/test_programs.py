"""Compiled programs: every step program is built at start-up and nothing compiles afterwards, a sealed
runner runs a missing bucket in a larger compiled one, and the sampling settings (greedy, sampled, top-k /
top-p, log-probabilities, logit bias, penalties, min_p, min_tokens, allowed tokens) are runtime arrays of those
programs."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jhybrid import LLM, SamplingParams
from jhybrid.engine.compilation import CompileWatch
from tests.conftest import ENGINE, GREEDY

# `ENGINE` (tests/conftest.py, the engine tests' shapes): a small pool (preemption and re-prefill), a small
# token budget (chunked prefill), 4 rows


@pytest.fixture(scope="module")
def model(tiny):
    return tiny[1]


def mixed_workload(seed: int, n: int = 10, vocab: int = 128, lengths: tuple[int, int] = (1, 250)):
    """Random prompt (in `lengths`) and output lengths; greedy, sampled, filtered, log-probability, biased,
    penalised, min_p + allowed-token and min_tokens requests."""
    rng = np.random.default_rng(seed)
    work = []
    for i in range(n):
        prompt = rng.integers(0, vocab, size=int(rng.integers(*lengths))).tolist()
        kind = i % 8
        kw = dict(max_tokens=int(rng.integers(1, 12)), ignore_eos=True)
        if kind == 0:
            kw.update(temperature=0.0)
        elif kind == 1:
            kw.update(temperature=0.9, seed=i)
        elif kind == 2:
            kw.update(temperature=1.1, top_k=7, top_p=0.8, seed=i)
        elif kind == 3:
            kw.update(temperature=0.0, logprobs=3)
        elif kind == 4:
            kw.update(temperature=0.7, seed=i, logit_bias={int(t): 3.0 for t in rng.integers(0, vocab, 5)})
        elif kind == 5:
            kw.update(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3)
        elif kind == 6:
            kw.update(temperature=0.9, seed=i, min_p=0.05, allowed_token_ids=rng.integers(0, vocab, 20).tolist())
        else:
            kw.update(temperature=0.8, seed=i, min_tokens=kw["max_tokens"], stop_token_ids=[int(rng.integers(vocab))],
                      ignore_eos=False)
        work.append((prompt, SamplingParams(**kw)))
    return work


def run(llm: LLM, work, abort_at: dict[int, int]) -> dict[str, list[int]]:
    """Runs `work` through the engine, aborting request i at step `abort_at[i]`; returns the tokens of each."""
    eng = llm.engine
    seqs = {f"r{i}": eng.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(work)}
    step = 0
    while eng.has_unfinished():
        for i, at in abort_at.items():
            if at == step:
                eng.abort(f"r{i}")
        eng.step()
        step += 1
    for rid in seqs:
        eng.release(rid)
    assert eng.blocks.num_used == 0 and eng.slots.num_used == 0
    return {rid: (s.finish_reason, s.output_ids) for rid, s in seqs.items()}


# a host tier with swap preemption and the prefix cache's host tier: their programs are warmed too (before,
# each swap size and `jnp.asarray`'s staging of the swap's block ids compiled at the first swap, after ready)
TIERED = dict(host_kv_memory_gb=0.01, preemption_mode="swap", enable_prefix_caching=True)


@pytest.mark.parametrize("extra", [{}, pytest.param(TIERED, id="host-tier")])
def test_after_warmup_a_random_mixed_workload_compiles_nothing(model, extra):
    """`warmup=True` compiles every step program (and the slot programs) at start; then a random workload —
    prompt and output lengths, greedy and sampled requests, top-k / top-p, log-probabilities, logit bias,
    penalties, min_p, allowed tokens, min_tokens, aborts, preemptions — compiles nothing: JAX's own compile event never fires (this counts every XLA
    compilation in the process, whatever function caused it). Its tokens equal those of an engine that
    compiled on demand. Checked to fail: with `warmup=False` the watch counts the workload's compiles; in the
    host-tier case (swaps and the prefix cache's moves to and from the host) also with `warm_swap_programs` not
    called, with the prefix tier's `warm` not called, and with the swaps' block ids passed through `jnp.asarray`
    again. After `close()`, another engine's compiles are not counted as this one's (checked to fail without
    it)."""
    jax.clear_caches()  # an earlier test of this process may have compiled these shapes: warm-up must compile them
    warm = LLM(model, **ENGINE, **extra, warmup=True)
    stats = warm.engine.stats()
    grid = warm.engine.runner.program_grid(4, 128)
    assert grid == [(False, 64, 4), (False, 128, 4), (True, 4, 4)]  # one decode bucket, two mixed: sampling is
    # not a program
    assert stats["startup_programs_compiled"] >= len(grid)
    work = mixed_workload(seed=1, lengths=(120, 300))  # four of them need more than ENGINE's 44 blocks
    aborts = {2: 3, 7: 9}
    with CompileWatch() as watch:
        got = run(warm, work, aborts)
        assert warm.engine.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert watch.count == 0, f"{watch.count} programs compiled after warm-up: {watch.names}"
    stats = warm.engine.stats()
    assert stats["programs_compiled_after_ready"] == 0
    if extra:
        assert stats["num_swap_out"] > 0 and stats["num_swap_in"] > 0, "the workload was meant to swap"
    cold = LLM(model, **ENGINE, **extra)
    assert got == run(cold, work, aborts)
    warm.engine.close()  # done: later compiles of the process (another engine's) are not this one's stalls
    jax.jit(lambda x: x * 3 + 1)(np.arange(5))  # a fresh program
    assert warm.engine.stats()["programs_compiled_after_ready"] == 0  # fails without close()


def test_warmup_returns_once_the_queued_slot_programs_compiled(model, monkeypatch):
    """With the dispatch thread on, the slot programs warm-up runs (`ModelRunner.warm_slot_programs`) are queued
    there; it returns only once they have compiled, so none compiles after the engine reports ready (on the H200
    `jit(copy_slots)` did: its compile finished after ready). The copy is slowed here so that the race is always
    lost without the wait. Checked to fail with the final `drain()` removed from `warm_slot_programs`."""
    import time

    import jhybrid.engine.runner as runner_module

    llm = LLM(model, **ENGINE, enable_prefix_caching=True)  # snapshot slots: copy_slots is warmed
    runner = llm.engine.runner
    assert runner.cache.num_snapshot_slots > 0
    runner.dispatch_thread = True
    copy_slots = runner_module.copy_slots
    copy_slots.clear_cache()  # it must compile in this warm-up, not come from an earlier test

    def slow_copy(*args):
        time.sleep(0.5)
        return copy_slots(*args)

    monkeypatch.setattr(runner_module, "copy_slots", slow_copy)
    runner.warm_slot_programs()
    with CompileWatch() as after:
        runner.drain()  # whatever was still queued compiles now
        for n in range(1, runner.max_rows + 1):  # every count a step can ask for runs in a warmed size
            runner.zero_slots([0] * n)
            runner.copy_slots([(0, 0)] * n)
        runner.drain()
    assert after.count == 0, after.names
    assert runner.slot_buckets() == [1, 4] and runner.max_rows == 4


def test_compile_watch_names_what_compiled(caplog):
    """`CompileWatch` keeps the name of each program compiled while it is open and, with `warn`, logs a warning
    naming it (how a server's log says what compiled on the request path); nothing before it opened or after it
    closed. Checked to fail with the name left out of the warning and with `names` not appended."""
    import jax
    import jax.numpy as jnp

    def before_the_watch(x):
        return x * 3

    def under_the_watch(x):
        return jnp.sin(x) + 1

    x = jnp.arange(5.0)
    jax.jit(before_the_watch)(x)
    with caplog.at_level("WARNING", logger="jhybrid.engine"), CompileWatch(warn="after ready") as watch:
        jax.jit(under_the_watch)(x)
    jax.jit(lambda y: y - 1)(x)
    assert watch.names == ["jit(under_the_watch)"], watch.names
    assert watch.count == 1
    assert any("jit(under_the_watch)" in r.getMessage() and "after ready" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_sealed_runner_runs_a_missing_bucket_in_a_larger_one(model):
    """With only the largest decode and mixed buckets compiled and the runner sealed, every step runs in those
    (padding rows and tokens) without compiling, and gives the tokens of exact buckets (those of the `ENGINE`
    shapes the other tests here compile: fewer rows and tokens per step, the same greedy tokens). Checked to fail:
    without `seal()` the smaller buckets compile (the watch counts them)."""
    engine = dict(ENGINE, max_num_seqs=8, max_num_batched_tokens=256)
    big = LLM(model, **engine)
    runner = big.engine.runner
    assert runner.max_rows == 8 and runner.max_tokens_bucket == 256
    runner.compile_all([(True, 8, 8), (False, 256, 8)], threads=2)
    runner.warm_slot_programs()
    runner.seal()
    work = [(p, SamplingParams(max_tokens=sp.max_tokens, **GREEDY)) for p, sp in mixed_workload(seed=2, n=5)]
    with CompileWatch() as watch:
        got = run(big, work, {})
    assert watch.count == 0
    assert runner.compiled_shapes <= {((8, 8, runner.max_blocks), True, None), ((256, 8, runner.max_blocks), False, None)}
    exact = LLM(model, **ENGINE)
    assert got == run(exact, work, {})
    assert any(layout[0] < 256 for layout, *_ in exact.engine.runner.compiled_shapes)  # it did use smaller ones


def test_logit_bias_moves_the_choice_and_not_the_logprobs(model):
    """A +bias that lifts the runner-up above the top token makes greedy pick it; -100 on the top token does
    too; the reported log-probabilities stay the model's (unbiased). The expectations come from the
    unbiased run's own top-2 log-probabilities, not from the biased code path. Checked to fail: with the
    bias not added in `sample`, the first assertion fails."""
    llm = LLM(model, **ENGINE)
    prompt = list(range(3, 40))
    (base,) = llm.generate([prompt], SamplingParams(max_tokens=1, logprobs=2, **GREEDY))
    (first, second), (lp1, lp2) = list(base.logprobs[0]), list(base.logprobs[0].values())
    assert base.token_ids == [first]
    lift = SamplingParams(max_tokens=1, logprobs=2, logit_bias={second: (lp1 - lp2) + 0.5}, **GREEDY)
    (lifted,) = llm.generate([prompt], lift)
    assert lifted.token_ids == [second]
    np.testing.assert_allclose(list(lifted.logprobs[0].values()), [lp1, lp2], rtol=1e-5)
    (banned,) = llm.generate([prompt], SamplingParams(max_tokens=1, logit_bias={first: -100.0}, **GREEDY))
    assert banned.token_ids == [second]
    # a biased request next to unbiased ones, in one step, and the slot's bias does not leak to the next user
    outs = llm.generate([prompt, prompt], [SamplingParams(max_tokens=1, logit_bias={first: -100.0}, **GREEDY),
                                           SamplingParams(max_tokens=1, **GREEDY)])
    assert [o.token_ids for o in outs] == [[second], [first]]
    (after,) = llm.generate([prompt], SamplingParams(max_tokens=1, **GREEDY))
    assert after.token_ids == [first]


def test_step_programs_use_cublas_gemms_on_the_gpu_unless_xla_flags_say(monkeypatch):
    # Fails if the GPU default is dropped (the first assert) or if it overrides a user's XLA_FLAGS (the last).
    from jhybrid.engine.runner import default_compiler_options
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=4")
    assert default_compiler_options("gpu") == {"xla_gpu_enable_triton_gemm": False}
    assert default_compiler_options("cpu") is None
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    assert default_compiler_options("gpu") is None


def test_graph_conditionals_switch_lists_every_default_kind_and_parses(monkeypatch):
    # The option replaces XLA's list of command-buffer kinds, so the switch must name the defaults too; the value must
    # also be one XLA parses (a "+CONDITIONAL" is refused: checked). Fails if the switch adds nothing, drops a default
    # kind, or yields a value XLA rejects (compiled here on the CPU, whose DebugOptions parse the same option).
    import jax
    import jax.numpy as jnp

    from jhybrid.engine import runner

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(runner, "GRAPH_CONDITIONALS", True)
    options = runner.default_compiler_options("gpu")
    kinds = options["xla_gpu_enable_command_buffer"].split(",")
    assert {"CONDITIONAL", "WHILE"} <= set(kinds)
    assert {"FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "DYNAMIC_SLICE_FUSION"} <= set(kinds)
    f = jax.jit(lambda x: jax.lax.cond(x.sum() > 0, lambda y: y + 1, lambda y: y - 1, x))
    compiled = f.lower(jnp.ones(3)).compile(compiler_options={"xla_gpu_enable_command_buffer": ",".join(kinds)})
    assert list(compiled(jnp.ones(3))) == [2.0, 2.0, 2.0]
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")  # the user's choice wins
    assert "xla_gpu_enable_command_buffer" not in runner.default_compiler_options("gpu")


def test_few_row_decode_programs_keep_triton_gemms(model, monkeypatch):
    # Decode programs of at most TRITON_GEMM_MAX_ROWS rows compile with Triton GEMM fusions on where the runner's
    # options turned them off; prefill and larger decode programs, a user's XLA_FLAGS and the CPU keep theirs. Checked
    # to fail with the rows' bound dropped (16 rows got them), with the decode check dropped (the prefill got them),
    # and with `_compile` given the runner-wide options (the 4-row program compiled with cuBLAS).
    from jhybrid.engine import runner as runner_module

    off = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 4}
    on = dict(off, xla_gpu_enable_triton_gemm=True)
    monkeypatch.setattr(runner_module, "TRITON_GEMM_MAX_ROWS", 8)
    options = runner_module.program_compiler_options
    assert options(off, True, 4) == on and options(off, True, 8) == on
    assert options(off, True, 16) == off and options(off, False, 4) == off
    assert options({"xla_gpu_autotune_level": 4}, True, 4) == {"xla_gpu_autotune_level": 4}  # XLA_FLAGS named it
    assert options(None, True, 4) is None  # the CPU's
    assert off == {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 4}  # not changed in place
    monkeypatch.setattr(runner_module, "TRITON_GEMM_MAX_ROWS", 0)
    assert options(off, True, 4) == off

    monkeypatch.setattr(runner_module, "TRITON_GEMM_MAX_ROWS", 8)
    runner = LLM(model, **ENGINE).engine.runner
    monkeypatch.setattr(runner, "compiler_options", off)
    seen = []

    class Lowered:
        def compile(self, compiler_options):
            seen.append(compiler_options)
            return "program"

    for key in [(True, 4, 4), (False, 64, 4), (True, 16, 16), (True, 4, 4, False, 8, None)]:
        runner._compile(Lowered(), None, key)
    assert seen == [on, off, off, on]
