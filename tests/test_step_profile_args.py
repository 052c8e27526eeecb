"""`benchmarks.step_profile` refuses a program that its engine could not hold, before building anything."""

import pytest


def test_a_row_longer_than_max_model_len_is_refused_with_its_numbers(capsys):
    """A real row of 1,000 tokens of context and its step's token in a 776-token engine: exit 2 naming the program,
    the row's length and the limit (it had died on a NumPy broadcast error while filling the block table). Checked to
    fail with the check taken out (the script then builds the engine and fails elsewhere)."""
    from benchmarks import step_profile

    with pytest.raises(SystemExit) as e:
        step_profile.main(["--tiny", "--programs", "decode:4:4:1@1000", "--max-model-len", "776"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "decode:4:4:1@1000" in err and "1001 tokens" in err and "--max-model-len 776" in err
    with pytest.raises(SystemExit):  # a mixed step's prompt row: 700 of context and 60 new tokens past 740
        step_profile.main(["--tiny", "--programs", "mixed:64:4:4@700", "--max-model-len", "740"])
    assert "a row of 760 tokens" in capsys.readouterr().err
