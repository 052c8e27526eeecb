"""`runner.SMALL_ENGINE_ROWS`: an engine of fewer sequences than `MIN_ROWS` runs row buckets of its own size."""

from __future__ import annotations

import pytest

import jhybrid
from jhybrid import LLM, SamplingParams
from jhybrid.engine import runner
from tests.conftest import GREEDY


@pytest.mark.slow  # three engines compile their programs (~30 s)
def test_single_sequence_engine_runs_one_row_programs_with_the_same_tokens(monkeypatch):
    """A `max_num_seqs=1` engine on the bundled model (fp32): with the switch on, every step program it builds has 1
    row, single decode steps and 4-step programs alike (`num_scheduler_steps=4`), and its greedy and seeded sampled
    tokens equal those of the 4-row programs of the switch off. Checked to fail with the switch ignored (4-row programs), and with the decode bucket taken as 4
    rows while the engine holds 1 (`max_rows` 1, `buckets` unclamped: a shape error)."""
    prompts = ["And God said", "In the beginning God created the heaven"]
    params = [SamplingParams(max_tokens=12, **GREEDY), SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9,
                                                                       seed=5)]

    def run(small: bool, steps: int = 1):
        monkeypatch.setattr(runner, "SMALL_ENGINE_ROWS", small)
        llm = LLM(jhybrid.default_model_path(), dtype="float32", max_num_seqs=1, max_model_len=64,
                  num_scheduler_steps=steps)
        outs = [llm.generate([p], sp)[0].token_ids for p in prompts for sp in params]
        return outs, {key[2] for key in llm.engine.runner._programs}, {key[4] for key in llm.engine.runner._programs
                                                                          if len(key) > 4}

    base, base_rows, _ = run(False)
    small, small_rows, _ = run(True)
    multi, multi_rows, bursts = run(True, steps=4)  # 4 decode steps a program, in 1 row
    assert base_rows == {4}, base_rows
    assert small_rows == {1} and multi_rows == {1} and bursts == {4}, (small_rows, multi_rows, bursts)
    assert small == base and multi == base and all(len(t) == 12 for t in small)
