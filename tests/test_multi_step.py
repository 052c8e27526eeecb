"""Multi-step decode (`num_scheduler_steps`): while every running sequence decodes and none waits, several decode
steps run in one program, each step's sampled tokens fed to the next on the device (`ModelRunner`'s burst
programs, `Scheduler._burst`). It must change no output: the tokens, texts, finish and stop reasons and logprobs
of single steps, whatever stops a sequence inside a burst; what a row runs after its own last step must leave its
KV and state as they were; and a warmed-up engine must build the programs before it is ready and never compile one
afterwards."""

from __future__ import annotations

import json

import jax
import pytest

from jhybrid import LLM, SamplingParams
from jhybrid.cache.allocator import BlockAllocator, SlotAllocator
from jhybrid.engine.compilation import CompileWatch
from jhybrid.engine.engine_config import OFFLINE_SCHEDULER_STEPS
from jhybrid.engine.llm_engine import LLMEngine
from jhybrid.engine.scheduler import Scheduler
from jhybrid.engine.sequence import Sequence
from tests.conftest import ENGINE
from tests.example_ckpt import write_example_checkpoint
from tests.test_deferred_read import PROMPTS, _params, _same
from tests.test_programs import mixed_workload, run

K = 4  # decode steps per multi-step program in these tests


def _steps(llm: LLM, k: int) -> None:
    """Sets the engine's decode steps per program (the scheduler decides, the runner builds programs of `k`)."""
    llm.engine.scheduler.num_scheduler_steps = llm.engine.runner.burst_steps = k


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_example_checkpoint(tmp_path_factory.mktemp("multistep") / "ckpt", seed=7)
    return LLM(path, dtype="float32", max_num_seqs=5, max_model_len=128, max_num_batched_tokens=16,
               num_scheduler_steps=K)


def _workload() -> list[SamplingParams]:
    """`test_deferred_read`'s requests (stop strings with and without their text, EOS, stop token ids, the length
    limit, a grammar; logprobs, min_tokens, sampling), and sampled or greedy ones with penalties, logit bias,
    allowed tokens and a banned word (bad_words of one token), each at a length that is no multiple of `K`."""
    extra = [dict(temperature=0.0, logit_bias={5: 4.0, 77: 2.0}, logprobs=2),
             dict(allowed_token_ids=list(range(30, 90)), min_p=0.05, seed=2),
             dict(bad_words=["e"], top_k=9, top_p=0.9, seed=3, logprobs=1),
             dict(temperature=0.0, ignore_eos=True),
             # the bias makes token 42 the choice until the penalties for its first occurrence outweigh it
             dict(temperature=0.0, presence_penalty=1.5, frequency_penalty=2.0, repetition_penalty=1.3, ignore_eos=True,
                  logit_bias={42: 3.0})]
    # the last ones run after the queue is empty: in bursts
    return _params() + [SamplingParams(**{"max_tokens": 9 + 5 * i, "temperature": 0.8, **kw})
                        for i, kw in enumerate(extra)]


def _outputs(llm: LLM, k: int) -> list[tuple]:
    _steps(llm, k)
    params = _workload()
    got = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params, use_tqdm=False)
    return [(o.text, o.token_ids, o.finish_reason, o.stop_reason, o.logprobs) for r in got for o in r.outputs]


def test_multi_step_decode_changes_no_output(llm):
    """The same texts, tokens, finish and stop reasons and logprob entries with `K` decode steps per program as
    with one, on a workload that ends requests inside bursts by stop strings, stop token ids, EOS and length,
    with seeded sampling, top-k / top-p, min_p, penalties, logit bias, allowed tokens, banned words and logprobs
    (each a part of the sampler's plan). Checked to fail: with the sampling counter not advanced between inner
    steps (sampled tokens differ), with the penalties' history not recording the inner steps' fed tokens, and
    with a burst's top logprobs read at the row's index of the first inner step."""
    before = _outputs(llm, 1)
    bursts = llm.engine.runner.num_bursts
    assert bursts == 0
    after = _outputs(llm, K)
    assert llm.engine.runner.num_bursts > bursts, "the workload was meant to run multi-step programs"
    assert {"stop", "length"} <= {r[2] for r in before}
    _same(after, before)


def test_steps_after_a_rows_own_leave_its_kv_and_state_alone(tmp_path):
    """A row whose length limit ends it inside a burst runs the burst's remaining inner steps on the null slot
    and page: the KV block it filled last and the state snapshot taken at its end stay those of its real tokens.
    With prefix caching, a request that continues such a sequence (its prompt, output and more) reuses that
    block and snapshot; its output (tokens, and logprobs to 1e-4: fp32) must equal the same request's on an engine
    without the cache. Several output lengths put the end at different inner steps, each at a block boundary (where
    the snapshot is). Checked to fail with the inner steps of rows past their own writing their slot (no null slot),
    and, separately, writing their last position's KV again (no null page)."""
    path = write_example_checkpoint(tmp_path / "ckpt", seed=3)
    shape = dict(dtype="float32", max_num_seqs=4, max_model_len=160, max_num_batched_tokens=64, block_size=16)
    cached = LLM(path, **shape, enable_prefix_caching=True, num_scheduler_steps=K)
    plain = LLM(path, **shape, num_scheduler_steps=1)  # single steps on a GPU too
    greedy = dict(temperature=0.0, ignore_eos=True)
    long_one = SamplingParams(max_tokens=60, **greedy)  # keeps the bursts going after the short one ends
    hits = 0
    # prompt + output - 1 = 32 computed tokens (two full blocks); the decode feeds (new - 1) end 2, 1 and 3 steps
    # into the last burst
    for length, new in ((26, 7), (27, 6), (29, 4)):
        prompt = list(range(3, 3 + length))
        first = cached.generate([prompt, list(range(90, 111))], [SamplingParams(max_tokens=new, **greedy), long_one],
                                use_tqdm=False)[0].outputs[0].token_ids
        follow = prompt + list(first) + [7, 8, 9]
        follow_up = SamplingParams(max_tokens=6, logprobs=5, **greedy)
        want = plain.generate([follow], follow_up, use_tqdm=False)[0].outputs[0]
        got = cached.generate([follow], follow_up, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want.token_ids, (length, new)
        worst = max(abs(e.logprob - want.logprobs[i][t].logprob) for i, lp in enumerate(got.outputs[0].logprobs)
                    for t, e in lp.items())
        print(f"prompt {length}, {new} new: worst logprob difference {worst:.2e}")
        assert worst < 1e-4, (length, new, worst)
        hits += got.num_cached_tokens == 32
    assert hits == 3, "each follow-up was meant to resume at the short sequence's end"
    assert cached.engine.runner.num_bursts > 0


def test_a_burst_waits_for_the_queue_and_stops_at_the_length_limit():
    """The scheduler runs a multi-step step only when every row decodes and nothing waits; each row runs as many
    steps as its length limit leaves (never past max_tokens), and gets the blocks for them."""
    blocks, slots = BlockAllocator(64, 4), SlotAllocator(4)
    sched = Scheduler(blocks, slots, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64, num_scheduler_steps=K)
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=3))
    b = Sequence("b", [4, 5, 6, 7, 8], SamplingParams(max_tokens=20))
    sched.add(a)
    first = sched.schedule()  # a's prompt
    assert first.burst == 1
    a.num_pending, a.token_ids = 0, a.token_ids + [9]  # its first token read
    sched.add(b)
    second = sched.schedule()  # a decodes beside b's prompt: plain
    assert second.burst == 1 and [r.num_tokens for r in second.rows] == [1, 5]
    for seq, token in ((a, 10), (b, 11)):
        seq.num_pending, seq.token_ids = 0, seq.token_ids + [token]
    third = sched.schedule()
    assert third.burst == K
    assert [(r.seq.request_id, r.start, r.steps) for r in third.rows] == [("a", 4, 1), ("b", 5, K)]
    assert a.num_tokens == 6 and b.num_tokens == 6 + K  # a: its max_tokens (3 outputs); b: K more
    assert len(b.block_table) * 4 >= b.num_computed == 5 + K
    sched.add(Sequence("c", [1], SamplingParams(max_tokens=2)))
    for r in third.rows:  # read: the burst's tokens reach the host
        r.seq.token_ids += [0] * r.steps
        r.seq.num_pending = 0
    sched.finish(a, "length")
    assert sched.schedule().burst == 1  # c waited: admitted in a plain step


def test_default_steps_single_for_the_engine_multi_step_for_the_offline_api_on_a_gpu(tiny):
    """`num_scheduler_steps` left at its default (None): an `LLMEngine` built directly (as the server builds it)
    runs single steps, so that streams get their tokens one at a time; `LLM` (the offline API) resolves it with
    `offline_defaults`: `OFFLINE_SCHEDULER_STEPS` on a GPU, 1 on the CPU (where this suite runs). Checked to fail
    with `LLMEngine` passing None on to the scheduler (it raises), and with `LLM` not resolving the default (its
    config keeps None)."""
    engine = LLMEngine(tiny[1], **ENGINE)
    assert engine.config.num_scheduler_steps is None
    assert engine.scheduler.num_scheduler_steps == engine.runner.burst_steps == 1
    engine.close()
    llm = LLM(tiny[1], **ENGINE)
    want = OFFLINE_SCHEDULER_STEPS if jax.default_backend() == "gpu" else 1
    assert llm.engine.config.num_scheduler_steps == want
    assert llm.engine.scheduler.num_scheduler_steps == llm.engine.runner.burst_steps == want
    assert llm.engine.runner.burst_background and not engine.runner.burst_background  # the default's compiles
    llm.engine.close()
    asked = LLM(tiny[1], **ENGINE, num_scheduler_steps=2)  # asked for: compiled when first needed, as before
    assert asked.engine.runner.burst_steps == 2 and not asked.engine.runner.burst_background
    asked.engine.close()


def test_warmup_builds_the_multi_step_programs_and_a_sealed_engine_compiles_none(tiny):
    """With `warmup=True` the engine builds the multi-step programs of its row buckets (greedy and sampling
    plans) before it is ready; a random workload (preemptions, aborts, every sampling control) then compiles
    nothing: steps whose plan has no program (penalties, allowed tokens, bias, logprobs) run one token at a time.
    Its tokens equal those of an engine without multi-step decode. Checked to fail: without `burst_grid` in the
    warm-up grid the watch counts the multi-step programs' compiles."""
    model = tiny[1]
    jax.clear_caches()
    warm = LLM(model, **ENGINE, warmup=True, num_scheduler_steps=K)
    grid = warm.engine.runner.burst_grid(ENGINE["max_num_seqs"])
    assert len(grid) == 3 and all(key[4] == K for key in grid)  # one decode bucket x three plans
    work = mixed_workload(seed=3, n=16, lengths=(20, 200))
    aborts = {2: 3, 9: 12}
    with CompileWatch() as watch:
        got = run(warm, work, aborts)
    assert watch.count == 0, f"{watch.count} programs compiled after warm-up: {watch.names}"
    assert warm.engine.stats()["programs_compiled_after_ready"] == 0
    assert warm.engine.runner.num_bursts > 0
    single = LLM(model, **ENGINE, num_scheduler_steps=1)  # single steps on a GPU too (where LLM's default is 8)
    assert got == run(single, work, aborts)
    warm.engine.close()


def test_served_streams_with_multi_step_decode(tmp_path):
    """`jhybrid serve --num-scheduler-steps 4` (warmed up): concurrent streamed completions bring the text and
    token count of the same requests unstreamed and of an engine without multi-step decode; the inter-token
    latency histogram counts every token after the first (a burst's tokens arrive together)."""
    import asyncio

    import httpx

    from jhybrid.server import BackgroundServer, ServerConfig, build_engine, create_app
    from tests.test_server import scrape

    path = write_example_checkpoint(tmp_path / "ckpt", seed=5)
    shape = dict(dtype="float32", served_model_name="tiny", max_num_seqs=4, max_model_len=96,
                 max_num_batched_tokens=16, warmup=True)
    bodies = [{"model": "tiny", "prompt": f"Hi {i}", "max_tokens": 9 + 2 * i, "ignore_eos": True,
               "temperature": 0.0} for i in range(3)] + [
              {"model": "tiny", "prompt": "Ok", "max_tokens": 12, "temperature": 0.7, "seed": 4}]

    async def stream(client, url, body):
        async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
            events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

    async def run(url):
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(stream(client, url, b) for b in bodies))

    texts = {}
    for steps in (4, 1):
        engine = build_engine(path, **shape, num_scheduler_steps=steps)
        server = BackgroundServer(create_app(engine, ServerConfig(model_names=("tiny",)))).start()
        try:
            before = scrape(server.url)
            streamed = asyncio.run(run(server.url))
            whole = [httpx.post(server.url + "/v1/completions", json=b, timeout=120).json() for b in bodies]
            assert streamed == [w["choices"][0]["text"] for w in whole]
            assert [w["usage"]["completion_tokens"] for w in whole] == [b["max_tokens"] for b in bodies]
            after = scrape(server.url)
            key = "jhybrid:inter_token_latency_seconds_count"
            itl = after[key] - before.get(key, 0)
            assert itl == 2 * sum(b["max_tokens"] - 1 for b in bodies)
            texts[steps] = streamed
            if steps > 1:
                assert engine.engine.runner.num_bursts > 0
                assert engine.engine.stats()["programs_compiled_after_ready"] == 0
        finally:
            server.stop()
            engine.shutdown()
    assert texts[4] == texts[1]


@pytest.mark.slow
def test_multi_step_benchmark_checks_every_family(tmp_path):
    """`benchmarks/multi_step.py` on the floors' tiny configs of the three families (Gated DeltaNet + attention;
    Mamba2 + attention; lightning attention + MoE): its check finds each family's greedy tokens with 3 decode steps
    per program equal to single steps' (exit status 0), and multi-step programs ran. Checked to fail with the inner
    steps' positions not advanced (the tokens differ)."""
    from benchmarks import multi_step

    out = tmp_path / "ms.json"
    rc = multi_step.main(["--tiny", "--models", "qwen3_next,nemotron_h,minimax", "--batches", "2", "--steps", "1,3",
                          "--reps", "1", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert rc == 0, [r for row in rows for r in row["results"] if "error" in r]
    assert [row["model"] for row in rows] == ["qwen3_next", "nemotron_h", "minimax"]
    for row in rows:
        by_steps = {r["steps"]: r for r in row["results"]}
        assert by_steps[3]["multi_step_calls"] > 0 and by_steps[1]["multi_step_calls"] == 0, row["model"]


def test_background_compiles_run_plain_steps_until_the_program_is_ready(tiny, monkeypatch):
    """`ModelRunner.burst_background` (the offline default's mode): the first time a step could run multi-step, its
    program starts compiling on a thread of its own and the step runs plain, so no step waits for that compile; once
    compiled, steps of that row bucket and plan run multi-step. Tokens equal single steps' throughout. A job whose rows
    have fewer than `BACKGROUND_BURST_MIN` tokens left starts no compile. Checked to fail with `can_burst` answering
    True while the program is still missing (the burst compiles inline: a burst in the first call), with the compiled
    program never stored (no burst after waiting), and with the tokens-left check dropped (the short job compiles)."""
    import threading

    from jhybrid.engine import runner as runner_module
    from jhybrid.engine.runner import BURST_COMPILE_THREAD

    single = LLM(tiny[1], **ENGINE, num_scheduler_steps=1)
    llm = LLM(tiny[1], **ENGINE, num_scheduler_steps=K)
    runner = llm.engine.runner
    runner.burst_background = True
    gate, compile_step = threading.Event(), runner._compile

    def gated(low, cache_key, key):  # the background compile waits for the first call to end (a slower compile)
        if threading.current_thread().name.startswith(BURST_COMPILE_THREAD):
            gate.wait(120)
        return compile_step(low, cache_key, key)

    runner._compile = gated
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [[5, 17, 33, 2, 9]]
    want = single.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    llm.generate(prompt, greedy, use_tqdm=False)  # a short job: no compile started for it
    assert not runner._burst_compiling and runner.num_bursts == 0
    monkeypatch.setattr(runner_module, "BACKGROUND_BURST_MIN", 8)  # 12 tokens now count as a long job
    first = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert runner.num_bursts == 0 and len(runner._burst_compiling) == 1
    gate.set()
    runner.wait_burst_compiles()
    again = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.runner.num_bursts > 0
    assert first == again == want
    for engine in (single.engine, llm.engine):
        engine.close()
