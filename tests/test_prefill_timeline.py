"""`benchmarks/prefill_timeline.py --zero-slots-ab` (session 51's probe of the slot-zeroing program's cost), on the
CPU with a tiny NemotronH-shaped model and the dispatch thread forced on, as on the GPU."""

import re

from benchmarks import prefill_timeline


def test_zero_slots_probe_drops_the_program_only_in_its_without_calls(monkeypatch, capsys, request):
    """With the step programs' own zeroing off (`runner.ZERO_IN_STEP`), each timed call lists the dispatch
    thread's program calls: the calls "with" the zeroing program show one `zero_slots` call before the step's, the
    calls "without" none, and the summary lines are printed. Checked to fail with the probe's replacement of
    `zero_slots` left out (every call then zeroes)."""
    import jax

    from jhybrid.engine import runner

    monkeypatch.setenv("JHYBRID_DISPATCH_THREAD", "1")
    monkeypatch.setattr(runner, "ZERO_IN_STEP", False)
    jax.clear_caches()  # the switch is read when the step program is traced
    request.addfinalizer(jax.clear_caches)  # no later test may reuse a step traced with the switch off
    prefill_timeline.main(["--model", "nemotron_h", "--tiny", "--length", "32", "--repeats", "2", "--zero-slots-ab"])
    out = capsys.readouterr().out
    calls = re.split(r"^generate #\d+ ", out, flags=re.M)[2:]  # the timed calls, after the compiling one
    assert len(calls) == 4
    for text in calls:
        programs = re.findall(r"dispatch thread: (\S+) called", text)
        assert programs[-1].startswith("mixed:"), text
        want = ["zero_slots"] if text.startswith("(with ") else []
        assert programs[:-1] == want, text
    assert re.search(r"^median of 2: generate [\d.]+ ms, step call [\d.]+ ms", out, flags=re.M)
    assert re.search(r"^zero-slots A/B, median of 2: with [\d.]+ ms, without [\d.]+ ms", out, flags=re.M)


def test_zero_slots_probe_refuses_while_the_step_programs_zero(monkeypatch):
    """With `ZERO_IN_STEP` on there is no separate program in a prefill step to time: the probe says so."""
    import pytest

    from jhybrid.engine import runner

    monkeypatch.setattr(runner, "ZERO_IN_STEP", True)
    with pytest.raises(SystemExit, match="JHYBRID_ZERO_IN_STEP=0"):
        prefill_timeline.main(["--model", "nemotron_h", "--tiny", "--length", "32", "--zero-slots-ab"])
