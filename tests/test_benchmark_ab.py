"""`benchmarks.ab`: interleaved A/B runs of one command under several environments, within a device call's budget."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import ab

PRINT_X = [sys.executable, "-c", "import os; print('noise 9'); print('value', os.environ.get('AB_X', '1'))"]


def test_variants_run_interleaved_and_metrics_are_read(tmp_path):
    """Two variants over two rounds run base, two, base, two, each in its own environment; the metric is the regex's
    last match (the 'noise' line does not match); the table gives the values in run order, the medians and the
    ratio to the first variant; every run's log and ab.json are written. Checked to fail with the rounds looped
    inside the variants (base, base, two, two) and with the variant's settings not passed to the run."""
    out = tmp_path / "ab"
    rc = ab.main(["--variant", "base:", "--variant", "two:AB_X=2", "--metric", r"v=^value ([\d.]+)", "--rounds", "2",
                  "--out", str(out), "--", *PRINT_X])
    assert rc == 0
    saved = json.loads((out / "ab.json").read_text())
    assert [(r["round"], r["variant"]) for r in saved["runs"]] == [(1, "base"), (1, "two"), (2, "base"), (2, "two")]
    assert [r["values"]["v"] for r in saved["runs"]] == [1.0, 2.0, 1.0, 2.0]
    assert "| v | two | 2, 2 | 2 | 2.000 |" in saved["table"]
    assert (out / "2-two.log").read_text().strip().endswith("value 2")


def test_no_run_starts_that_the_budget_cannot_hold(tmp_path):
    """A run that took more than half the budget leaves no room for another as long: the call stops after it, with
    its run recorded, instead of overrunning. Checked to fail with the budget check removed (three runs)."""
    sleep = [sys.executable, "-c", "import time; time.sleep(0.3); print('value 5')"]
    runs = ab.run_all(sleep, [("only", {})], [ab.parse_metric(r"v=value (\d+)")], rounds=3, budget_s=0.5,
                      timeout_s=10, out=str(tmp_path), log=lambda *a: None)
    assert len(runs) == 1 and runs[0]["values"] == {"v": 5.0}


def test_a_hung_run_is_killed_and_recorded(tmp_path):
    """A run past `timeout_s` is killed, recorded with rc "timeout" and no value, and the next variant still runs;
    the exit status says a run failed. Checked to fail with the timeout not passed to the run."""
    hang = [sys.executable, "-c", "import os, time; print('value 3', flush=True); "
            "time.sleep(30 if os.environ.get('AB_HANG') else 0)"]
    rc = ab.main(["--variant", "hang:AB_HANG=1", "--variant", "ok:", "--metric", r"v=value (\d+)", "--rounds", "1",
                  "--timeout-s", "2", "--out", str(tmp_path), "--", *hang])
    saved = json.loads((tmp_path / "ab.json").read_text())
    assert rc == 1
    assert [(r["variant"], r["rc"]) for r in saved["runs"]] == [("hang", "timeout"), ("ok", 0)]
    assert saved["runs"][1]["values"] == {"v": 3.0}


@pytest.mark.parametrize("args, message", [
    (["--variant", "nocolon", "--metric", r"v=(\d)"], "NAME:KEY=VALUE"),
    (["--variant", "a:X", "--metric", r"v=(\d)"], "KEY=VALUE"),
    (["--variant", "a:", "--metric", r"v=\d"], "needs a group"),
    (["--variant", "a:", "--variant", "a:X=1", "--metric", r"v=(\d)"], "must differ"),
])
def test_bad_specs_are_refused_with_the_reason(args, message, capsys):
    """A variant without a name or with a setting that is no KEY=VALUE, a metric regex without a group, and two
    variants of one name are refused, naming the problem."""
    with pytest.raises(SystemExit):
        ab.main([*args, "--", "true"])
    assert message in capsys.readouterr().err
