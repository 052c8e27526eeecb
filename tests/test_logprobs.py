"""Prompt log-probabilities offline (`SamplingParams(prompt_logprobs=k)`), checked against HF transformers.

The engine computes them in its prefill steps from the hidden states it has (`engine_step`'s prompt-logprob
programs, one per token bucket, built at warm-up); requests that do not ask keep the programs they had.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jhybrid import LLM, SamplingParams
from jhybrid.engine.compilation import CompileWatch
from tests.conftest import ENGINE, GREEDY

TOL = 1e-4  # fp32


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny[1], **ENGINE)  # 128-token steps: a 200-token prompt is prefilled in two chunks


def hf_logprobs(hf_model, ids: list[int]) -> np.ndarray:
    """HF's log_softmax of the logits at every prompt position, `[len(ids), V]` fp32."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids]), position_ids=torch.arange(len(ids))[None]).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).numpy()


def check_against_hf(hf_model, ids: list[int], got: list, k: int) -> None:
    """`got` (vLLM's shape) against HF: position 0 None; position q the prompt token's logprob and the top-k
    of the logits at q - 1 (ids and values)."""
    ref = hf_logprobs(hf_model, ids)
    assert len(got) == len(ids) and got[0] is None
    worst = 0.0
    for q in range(1, len(ids)):
        entry, row = got[q], ref[q - 1]
        top = np.argsort(-row, kind="stable")[:k].tolist()
        want = {ids[q]: row[ids[q]], **{t: row[t] for t in top}}
        assert set(entry) == set(want), f"position {q}: ids {sorted(entry)} != HF's {sorted(want)}"
        assert next(iter(entry)) == ids[q], f"position {q}: the prompt token comes first"
        worst = max(worst, max(abs(entry[t] - want[t]) for t in want))
    assert worst < TOL, f"prompt logprobs: max abs error {worst:.2e} against HF"


def test_prompt_logprobs_equal_hf_chunked_and_batched(tiny, llm):
    """A 200-token prompt (two chunks of the 128-token steps), a short one and one that asks for none share
    steps; each asking prompt's logprobs equal HF's log_softmax of its prompt logits (fp32, 1e-4), prompt token
    and top-k alike, and the generated tokens are those of the same requests without prompt logprobs.
    Checked to fail: with the targets shifted by one position (`plp_meta` filled from `first - 1`) the values
    differ, and with the second chunk's rows dropped from `_prompt_logprob_rows` positions 129.. stay None."""
    hf_model, _ = tiny
    rng = np.random.default_rng(3)
    long, short, other = (rng.integers(0, 128, size=n).tolist() for n in (200, 9, 40))
    params = [SamplingParams(max_tokens=3, prompt_logprobs=3, logprobs=2, **GREEDY),
              SamplingParams(max_tokens=3, prompt_logprobs=0, **GREEDY), SamplingParams(max_tokens=3, **GREEDY)]
    outs = llm.generate([long, short, other], params)
    check_against_hf(hf_model, long, outs[0].prompt_logprobs, 3)
    check_against_hf(hf_model, short, outs[1].prompt_logprobs, 0)
    assert all(len(e) == 1 for e in outs[1].prompt_logprobs[1:])  # k = 0: the prompt token alone
    assert outs[2].prompt_logprobs is None
    plain = llm.generate([long, short, other], SamplingParams(max_tokens=3, **GREEDY))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_only_requests_that_ask_run_prompt_logprob_programs(llm):
    """Steps without a row that asks run the programs they ran before (no prompt-logprob outputs); a step with
    one runs a prompt-logprob program of all rows. Checked to fail: with `plp = True` for every step in
    `execute`, the first assertion fails."""
    runner = llm.engine.runner
    seen = []
    execute = runner.execute

    def spy(sched, prev):
        result = execute(sched, prev)
        seen.append((any(r.seq.params.prompt_logprobs is not None for r in sched.rows), result.plp is not None))
        return result

    runner.execute = spy
    try:
        llm.generate([list(range(5, 60))] * 2, SamplingParams(max_tokens=4, **GREEDY))
        assert seen and not any(plp for _, plp in seen)
        seen.clear()
        llm.generate([list(range(5, 60)), list(range(9, 30))],
                     [SamplingParams(max_tokens=4, **GREEDY), SamplingParams(max_tokens=4, prompt_logprobs=1, **GREEDY)])
        assert (True, True) in seen  # the prefill step
        assert all(asks or not plp for asks, plp in seen)
    finally:
        del runner.execute


def test_prompt_logprobs_after_warmup_compile_nothing(tiny):
    """Warm-up builds the prompt-logprob programs (one per token bucket) with the others; then prompt-logprob
    requests of both token buckets, a chunked prompt and a one-token one included, compile nothing. Checked
    to fail: without `prompt_logprob_grid` in `warmup` the watch counts their compiles."""
    hf_model, model = tiny
    warm = LLM(model, **ENGINE, warmup=True)
    assert warm.engine.runner.prompt_logprob_grid(128) == [(False, 64, 4, True), (False, 128, 4, True)]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 128, size=n).tolist() for n in (1, 2, 30, 150)]
    with CompileWatch() as watch:
        outs = warm.generate(prompts, SamplingParams(max_tokens=2, prompt_logprobs=2, **GREEDY))
        warm.generate(prompts[2], SamplingParams(max_tokens=2, prompt_logprobs=2, **GREEDY))  # a 64-token step
    assert watch.count == 0, f"{watch.count} programs compiled after warm-up"
    assert outs[0].prompt_logprobs == [None]
    check_against_hf(hf_model, prompts[1], outs[1].prompt_logprobs, 2)


@pytest.mark.slow
def test_prompt_logprobs_survive_preemption(tiny, llm):
    """Four long prompts overflow `ENGINE`'s KV pool: sequences are preempted and their prompts recomputed;
    each one's prompt logprobs still equal HF's, and every prompt position was computed once (a recomputed
    prompt does not ask again for positions already read). Checked to fail: without the skip of read positions
    in `_prompt_logprob_rows` the count of positions asked exceeds the prompts'."""
    hf_model, _ = tiny
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 128, size=n).tolist() for n in (300, 280, 260, 250)]
    runner, asked = llm.engine.runner, []
    execute = runner.execute

    def spy(sched, prev):
        result = execute(sched, prev)
        asked.extend(n for *_, n in result.plp_rows)
        return result

    runner.execute = spy
    preemptions = llm.engine.num_preemptions
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, prompt_logprobs=1, **GREEDY))
    finally:
        del runner.execute
    assert llm.engine.num_preemptions > preemptions, "the pool was meant to be small enough to preempt"
    assert sum(asked) == sum(len(p) - 1 for p in prompts)
    for ids, out in zip(prompts, outs):
        check_against_hf(hf_model, ids, out.prompt_logprobs, 1)
