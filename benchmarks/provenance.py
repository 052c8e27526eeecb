"""Which tree a benchmark ran, for the JSON and logs every script writes.

The device tool runs a copy of the working tree whose git HEAD may be older than the files it holds (session 43's
`floors` JSON named the session's starting commit while running two commits past it), so a bare `git rev-parse`
named the wrong tree. `git_commit` marks a tree whose tracked files differ from HEAD, and takes the name from
`JHYBRID_COMMIT` when the caller knows better.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """`JHYBRID_COMMIT` if set; else HEAD's short hash, with "+dirty" when tracked files differ from it; "?" with
    no git or no repository."""
    if os.environ.get("JHYBRID_COMMIT"):
        return os.environ["JHYBRID_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return (head + ("+dirty" if dirty else "")) if head else "?"
