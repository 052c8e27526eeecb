"""`benchmarks.provenance.git_commit` names the tree a benchmark ran, on a throwaway git repository: HEAD's short
hash when the tracked files match it, "+dirty" when one differs (the device tool's copy of a working tree ahead of
its HEAD), `JHYBRID_COMMIT` over both, "?" outside a repository. Checked to fail with the dirty check dropped, and
with untracked files counted as dirty."""

from __future__ import annotations

import subprocess

from benchmarks import provenance


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_git_commit_names_head_and_marks_a_changed_tree(tmp_path, monkeypatch):
    monkeypatch.delenv("JHYBRID_COMMIT", raising=False)
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    assert provenance.git_commit() == "?"  # not a repository
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    assert provenance.git_commit() == head
    (tmp_path / "new.py").write_text("untracked\n")  # untracked files do not change the tree a run used
    assert provenance.git_commit() == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert provenance.git_commit() == head + "+dirty"
    monkeypatch.setenv("JHYBRID_COMMIT", "given")
    assert provenance.git_commit() == "given"
