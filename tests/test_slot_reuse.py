"""State slots handed from one request to the next start clean: a request's tokens and log-probabilities do
not depend on who held its slot before.

A linear layer's state (the recurrent state, and the conv state of Gated DeltaNet and Mamba2 layers) lives in
a slot that outlives its request; a slot handed to a new sequence is zeroed before its first step (by the step
program itself for a row that starts in a mixed step, `runner.ZERO_IN_STEP`; else by `ModelRunner.zero_slots`),
and a swapped-out sequence comes back into whatever slot is free. A dirty or
wrongly restored slot is the classic hybrid-model bug: the output stays fluent but is wrong. Every test here
runs one tiny random model per layer kind: Gated DeltaNet (Qwen3.5, with conv state), lightning attention
(MiniMax, no conv state) and Mamba2 (Bamba, with conv state), each with full-attention layers too. Each
request is compared, token for token and by its top-2 log-probabilities, with the same request run alone on
a fresh engine of the same shapes (so the compiled programs are shared).

How the tests were checked to fail: on a copy of the tree (`git archive HEAD` plus these tests) with one
change each, never committed, the file was run whole (the counts are of the 9 cases the file had then):
  * the engine's `self.runner.zero_slots(sched.new_slots)` call (`LLMEngine.step`) deleted: all 9 cases fail
    (by other tokens, or by log-probabilities off by 1.3e-3 to 1.2e-2: over 100x the tolerance). That was before
    mixed steps zeroed their starting rows themselves (session 51); since then the step program's zeroing
    (`runner._zero_started_rows`) left out fails the one-slot mixed-step case, and the engine's `zero_slots` given
    no slots fails the one-slot one-token case;
  * `zero_slots` (jhybrid/cache/state.py; now `zero_rows`, which both ways use) zeroing the recurrent state
    only, the conv state left dirty: the 6 Gated DeltaNet and Mamba2 cases fail, the 3 lightning ones pass
    (lightning has no conv state);
  * `zero_slots` zeroing the conv state only, the recurrent state left dirty: all 9 fail (the smallest miss,
    Mamba2 with recompute, by log-probabilities off by 7e-4);
  * `Swapper.swap_in` scattering the restored state into the null slot instead of the sequence's new slot:
    the 3 swap cases fail.
"""

from __future__ import annotations

import numpy as np
import pytest

from jhybrid import LLM, SamplingParams
from tests.conftest import FAMILY_ENGINE
from tests.hf_models import make_bamba, make_minimax, make_qwen3_5

# layer kind under test -> builder of a tiny random HF model holding it
FAMILIES = {
    "gated_deltanet": lambda p: make_qwen3_5(p, seed=21),
    "lightning": lambda p: make_minimax(p, seed=22),
    "mamba2": lambda p: make_bamba(p, seed=23),
}
# one shape set per engine kind, shared by every engine of this file (fresh engines reuse the programs)
ONE_SLOT = dict(dtype=None, max_num_seqs=1, max_model_len=96, max_num_batched_tokens=32)
# three slots and 10 KV blocks of 16 tokens (two 96-token sequences need 12): preemption. The family tests'
# engine, so their programs are shared (the same model configs, other weights)
POOL = FAMILY_ENGINE
HOST = dict(host_kv_memory_gb=0.01, preemption_mode="swap")


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    FAMILIES[request.param](path)
    return request.param, LLM(path, **ONE_SLOT).model  # loaded once; later engines take the LoadedModel


def prompt(seed: int, n: int, vocab: int = 128) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)


def assert_same(label: str, got_ids, got_lps, want_ids, want_lps) -> None:
    """Same tokens; at every position the same top-2 ids with log-probabilities within 5e-5 (a dirty slot
    moves them by 7e-4 and more; the same request in another batch or chunking by ~1e-6 on an Intel Xeon and
    up to 1.7e-5 on an AMD EPYC without AVX-512, where XLA's CPU code reduces in another order)."""
    assert got_ids == want_ids, f"{label}: tokens {got_ids} != alone {want_ids}"
    for pos, (got, want) in enumerate(zip(got_lps, want_lps, strict=True)):
        assert list(got) == list(want), f"{label}: position {pos}: top-2 ids {list(got)} != alone {list(want)}"
        err = np.abs(np.array(list(got.values())) - np.array(list(want.values()))).max()
        assert err <= 5e-5, f"{label}: position {pos}: log-probabilities off by {err:.2e} from alone"


def alone(model, prompt_ids: list[int], sp: SamplingParams, engine: dict):
    (out,) = LLM(model, **engine).generate([prompt_ids], sp)
    return out.token_ids, out.logprobs


# fast tier: Gated DeltaNet, whose slots hold both kinds of state (conv and recurrent) that `zero_slots` zeroes for
# every layer kind alike; lightning (recurrent only) and Mamba2 (both) are `slow`
@pytest.mark.parametrize("model", [name if name == "gated_deltanet" else pytest.param(name, marks=pytest.mark.slow)
                                   for name in FAMILIES], indirect=True)
@pytest.mark.parametrize("second_len", [21, 1], ids=["mixed-step", "one-token"])
def test_one_slot_the_next_request_gets_a_clean_slot(model, second_len):
    """`max_num_seqs=1`: there is one slot, so the second request runs in the slot the first one left (its
    state from 70 prompt and 16 generated tokens); its output equals its run on a fresh engine. A 21-token
    second prompt starts in a mixed step, whose program zeroes the slot (`runner.ZERO_IN_STEP`); a one-token one
    starts in a decode step, whose program does not, so the engine's separate `zero_slots` program must. Fails
    for every family with the zeroing removed (module docstring)."""
    name, loaded = model
    llm = LLM(loaded, **ONE_SLOT)
    assert llm.engine.cache.num_slots == 2, "one slot besides the null slot"
    first, second = prompt(1, 70), prompt(2, second_len)
    llm.generate([first], params(16))
    (out,) = llm.generate([second], params(10))
    assert_same(f"{name}: {second_len}-token second request in the first one's slot", out.token_ids, out.logprobs,
                *alone(loaded, second, params(10), ONE_SLOT))


@pytest.mark.parametrize("model", [name if name == "gated_deltanet" else pytest.param(name, marks=pytest.mark.slow)
                                   for name in FAMILIES], indirect=True)
def test_mixed_steps_zero_their_starting_rows_and_leave_the_rest_to_the_engine(model, monkeypatch):
    """`slots_zeroed_by_step` names exactly the slots of rows that start at position 0 in a mixed step, none in a
    decode step; the engine's `zero_slots` gets the step's other new slots. Checked to fail with a decode step's
    starting rows claimed by the program."""
    name, loaded = model
    llm = LLM(loaded, **POOL)
    eng = llm.engine
    zeroed, claimed = [], []
    real_zero = eng.runner.zero_slots
    monkeypatch.setattr(eng.runner, "zero_slots", lambda slots: zeroed.append(list(slots)) or real_zero(slots))
    real_claim = eng.runner.slots_zeroed_by_step

    def claim(sched):
        got = real_claim(sched)
        starting = {r.seq.slot for r in sched.rows if r.start == 0}
        claimed.append((sched.is_decode, got, starting, list(sched.new_slots)))
        return got

    monkeypatch.setattr(eng.runner, "slots_zeroed_by_step", claim)
    eng.add_request("long", prompt(5, 40), params(4))
    eng.add_request("one", prompt(6, 1), params(4))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps == 3:  # both prompts are in by now: a one-token request joins the running rows' decode steps
            eng.add_request("late", prompt(7, 1), params(3))
    assert claimed and len(zeroed) == len(claimed)
    for (decode, got, starting, new), host in zip(claimed, zeroed):
        assert got == (set() if decode else starting), (decode, got, starting)
        assert sorted(host) == sorted(s for s in new if s not in got)
    assert any(not decode and got for decode, got, _, _ in claimed), "no mixed step zeroed a row itself"
    assert any(decode and host for (decode, *_), host in zip(claimed, zeroed)), "no decode step left one to the engine"


@pytest.mark.parametrize("model,mode", [  # fast tier: Gated DeltaNet with swapping; the others are `slow`
    pytest.param(name, mode, marks=() if (name, mode) == ("gated_deltanet", "swap") else pytest.mark.slow)
    for name in FAMILIES for mode in ("recompute", "swap")], indirect=["model"])
def test_pool_reuses_slots_out_of_order_under_preemption_and_aborts(model, mode):
    """Three slots and a KV pool too small for three long sequences: requests of mixed lengths arrive over
    time, two are aborted mid-run (one running, one just admitted), the pool preempts (recomputed, or swapped
    to the host tier and restored into another slot), so slots are freed and handed out again out of arrival
    order. Every request that finishes equals its run alone on a fresh engine. Fails for every family with the
    zeroing removed, and in the swap case with the restored state scattered into the wrong slot (module
    docstring)."""
    name, loaded = model
    engine = POOL | (HOST if mode == "swap" else {})
    llm = LLM(loaded, **engine)
    eng = llm.engine
    lengths = [80, 7, 70, 1, 75, 18, 45, 3, 26]  # two of the long ones need 10 blocks of 16 or more; there are 10
    work = {f"r{i}": (prompt(10 + i, n), params(6 + (5 * i) % 11)) for i, n in enumerate(lengths)}
    arrive = {0: ["r0", "r1", "r2"], 2: ["r3", "r4"], 5: ["r5", "r6"], 9: ["r7", "r8"]}
    aborted = ["r1", "r7"]  # r1 at step 4, running; r7 right after its first step
    seqs, slots_of, handed, step = {}, {rid: [] for rid in work}, [], 0  # slots_of: each admission's slot
    while step <= max(arrive) or eng.has_unfinished():
        for rid in arrive.get(step, []):
            seqs[rid] = eng.add_request(rid, *work[rid])
        if step == 4:
            assert seqs["r1"].slot, "r1 was meant to hold a slot when aborted"
            eng.abort("r1")
        held = {rid: seq.slot for rid, seq in seqs.items()}
        eng.step()
        for rid, seq in seqs.items():
            if seq.slot and seq.slot != held[rid]:  # admitted (again) this step
                slots_of[rid].append(seq.slot)
                handed.append(seq.slot)
        if "r7" in seqs and seqs["r7"].slot and not seqs["r7"].is_finished:
            eng.abort("r7")
        step += 1
    # the workload did what it is meant to: preemption, slots reused, and not in first-in-first-out order
    assert eng.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    if mode == "swap":
        assert eng.scheduler.num_swap_preemptions > 0, "a preempted sequence was meant to swap out"
    assert any(len(set(s)) > 1 for s in slots_of.values()), f"no request came back in another slot: {slots_of}"
    assert handed != [1 + i % 3 for i in range(len(handed))], f"slots handed out in turn only: {handed}"
    assert eng.slots.num_used == 0 and eng.blocks.num_used == 0, f"{name}: slots or blocks leaked"
    for rid, (p, sp) in work.items():
        seq = seqs[rid]
        if rid in aborted:
            assert seq.finish_reason == "abort" and slots_of[rid], f"{rid}: {seq.finish_reason}, slots {slots_of[rid]}"
            continue
        assert seq.finish_reason == "length", f"{rid}: {seq.finish_reason}"
        assert_same(f"{name} {mode}: {rid} (slots {slots_of[rid]})", seq.output_ids, seq.logprobs,
                    *alone(loaded, p, sp, engine))
