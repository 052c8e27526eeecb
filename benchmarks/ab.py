"""Interleaved A/B runs of one benchmark command under several environment settings, for a device call.

    PYTHONPATH=. python3 -m benchmarks.ab --out $OUT/ab --rounds 2 --budget-s 400 \\
        --metric 'loop=^\\| minimax \\| [\\d.]+ \\| [\\d.]+ \\| ([\\d.]+)' \\
        --variant base: --variant 'split:JHYBRID_MOE_NARROW_TUNING={"block_n": 32, "split_k": 8}' \\
        -- python3 -m benchmarks.floors --decode-only --skip-kernels --only minimax --device-loop

Each round runs every variant once, in the order given (base, split, base, split, ...), so that a drift of the
machine (clocks, heat, another tenant) falls on all variants alike. A variant is `NAME:` followed by
`KEY=VALUE` settings separated by `;;` (none: the environment as it is). Each metric is `NAME=REGEX`: the first
group of the regex's last match in the run's output (stdout and stderr, multi-line mode), as a float.

What a device call needs and a shell loop lacked (session 45's third call hit its time limit mid-round and its base
runs' logs were lost):
- `--budget-s`: no run starts unless the longest run so far still fits in what is left, so the call ends with
  every finished run's log and the table, not a time-out;
- `--timeout-s`: one run's limit (a hung run is killed and recorded as failed);
- every run's output in `--out/<round>-<variant>.log` and the table and values in `--out/ab.json`, one folder to tar.

The table prints each variant's values in run order, their median, and the median's ratio to the first variant's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """`NAME:KEY=VALUE;;KEY=VALUE` -> (name, settings)."""
    name, sep, rest = text.partition(":")
    if not sep or not name:
        raise ValueError(f"a variant is NAME:KEY=VALUE;;..., got {text!r}")
    settings = {}
    for item in filter(None, rest.split(";;")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"variant {name!r}: a setting is KEY=VALUE, got {item!r}")
        settings[key] = value
    return name, settings


def parse_metric(text: str) -> tuple[str, re.Pattern]:
    """`NAME=REGEX` -> (name, compiled regex with at least one group)."""
    name, eq, pattern = text.partition("=")
    if not eq or not name:
        raise ValueError(f"a metric is NAME=REGEX, got {text!r}")
    regex = re.compile(pattern, re.MULTILINE)
    if regex.groups < 1:
        raise ValueError(f"metric {name!r}: the regex needs a group around the number")
    return name, regex


def extract(regex: re.Pattern, text: str) -> float | None:
    """The first group of the last match, as a float (None: no match, or not a number)."""
    matches = list(regex.finditer(text))
    if not matches:
        return None
    try:
        return float(matches[-1].group(1))
    except ValueError:
        return None


def run_all(command: list[str], variants: list[tuple[str, dict]], metrics: list[tuple[str, re.Pattern]], *,
            rounds: int, budget_s: float, timeout_s: float, out: str, log=print) -> list[dict]:
    """Runs `command` under each variant, interleaved for `rounds` rounds, within `budget_s`: a list of
    {round, variant, seconds, rc, log, values} in run order."""
    os.makedirs(out, exist_ok=True)
    runs, start, longest = [], time.perf_counter(), 0.0
    for r in range(1, rounds + 1):
        for name, settings in variants:
            left = budget_s - (time.perf_counter() - start)
            if longest > left:
                log(f"[ab] stopping: {left:.0f} s left, the longest run took {longest:.0f} s")
                return runs
            path = os.path.join(out, f"{r}-{name}.log")
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(command, env={**os.environ, **settings}, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, timeout=min(timeout_s, left))
                text, rc = proc.stdout, proc.returncode
            except subprocess.TimeoutExpired as exc:
                text = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
                rc = "timeout"
            seconds = time.perf_counter() - t0
            longest = max(longest, seconds)
            with open(path, "w") as f:
                f.write(text)
            values = {m: extract(regex, text) for m, regex in metrics}
            runs.append(dict(round=r, variant=name, seconds=seconds, rc=rc, log=path, values=values))
            shown = ", ".join(f"{m} {v}" for m, v in values.items())
            log(f"[ab] round {r} {name}: rc {rc}, {seconds:.0f} s; {shown}")
    return runs


def table(runs: list[dict], variants: list[str], metrics: list[str]) -> list[str]:
    """Per metric and variant: the values in run order, their median, and the median over the first variant's."""
    lines = ["| metric | variant | values in run order | median | vs " + variants[0] + " |", "|---|---|---|---:|---:|"]
    for m in metrics:
        medians = {}
        for v in variants:
            vals = [r["values"][m] for r in runs if r["variant"] == v and r["values"].get(m) is not None]
            medians[v] = statistics.median(vals) if vals else None
            base = medians.get(variants[0])
            ratio = f"{medians[v] / base:.3f}" if medians[v] is not None and base else "-"
            shown = ", ".join(f"{x:g}" for x in vals) or "-"
            med = f"{medians[v]:g}" if medians[v] is not None else "-"
            lines.append(f"| {m} | {v} | {shown} | {med} | {ratio} |")
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(usage="python3 -m benchmarks.ab [options] -- COMMAND ...",description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--variant", action="append", required=True, help="NAME:KEY=VALUE;;... (repeatable, in order)")
    ap.add_argument("--metric", action="append", required=True, help="NAME=REGEX with one group (repeatable)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=500.0, help="start no run that may not finish within this")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="one run's limit")
    ap.add_argument("--out", default="ab-out", help="folder for the runs' logs and ab.json")
    args = ap.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        ap.error("no command after --")
    try:
        variants = [parse_variant(v) for v in args.variant]
        metrics = [parse_metric(m) for m in args.metric]
    except ValueError as exc:
        ap.error(str(exc))
    names = [n for n, _ in variants]
    if len(set(names)) != len(names):
        ap.error(f"variant names must differ: {names}")
    runs = run_all(command, variants, metrics, rounds=args.rounds, budget_s=args.budget_s,
                   timeout_s=args.timeout_s, out=args.out)
    lines = table(runs, names, [m for m, _ in metrics])
    print("\n".join(lines), flush=True)
    with open(os.path.join(args.out, "ab.json"), "w") as f:
        json.dump(dict(command=command, variants=dict(variants), runs=runs, table=lines), f, indent=1)
    return 0 if runs and all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
