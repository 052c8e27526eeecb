"""`jhybrid serve` on one GPU, measured: start-up (cold and cached), load at several concurrencies, and the
offline engine on the same requests, in one run (issue 16, "Build" 4).

On the H200 (no network, no fastapi / uvicorn / prometheus_client in its image), from the repo root, with the
git-ignored .whl/ folder carried along (see "Wheels" below):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site:. && python3 -m benchmarks.serve_gpu --out $OUT

    PYTHONPATH=. python -m benchmarks.serve_gpu [--out DIR] [--concurrency 1,16,64,256] [--json PATH]
    PYTHONPATH=. python -m benchmarks.serve_gpu --tiny --concurrency 1,4 --out /tmp/sg     # CPU smoke test

Phases, each in a subprocess of its own (this process never touches the accelerator, so each phase has the
whole device), each under a timeout cut from one overall budget (`--time-budget`, 510 s by default, which
leaves room for the wheel install and clean-up inside a 10-minute device call):

1. Build: the 2.2 B Qwen3-Next-shaped dense hybrid of benchmarks/generate.py (its HF_CONFIG) with vocab 4096
   (1.62 B parameters, 3.2 GB in bf16) as an HF directory: config.json, model.safetensors with random bf16
   tensors of the names and shapes HF's `Qwen3NextForCausalLM` has (std 0.02 matrices, norms near identity,
   decays as benchmarks/generate.py draws them; torch draws them on the GPU when there is one), and the
   bundled kjv-tiny tokenizer files, so prompts are text; `jhybrid inspect`'s checks run on it. `--model-dir`
   keeps it (and reuses it next time).
2. Start-up: `python -m jhybrid.cli serve --model DIR --max-num-seqs 64 --max-model-len 2048 --port P`
   with a fresh, empty compilation cache (`--compilation-cache-dir` when `serve --help` lists it, and
   `JAX_COMPILATION_CACHE_DIR` in any case; XDG_CACHE_HOME points into the run's temporary folder so that a
   default user cache cannot make the "cold" start warm), timed from process start to `/health` answering
   200; SIGTERM; started again on the same cache and timed again ("cached"). Their logs, each line stamped
   with seconds since the process started, go to the out folder. `JAX_LOG_COMPILES=1` is set for the server
   (`--no-log-compiles` drops it): every XLA compile and persistent-cache hit is counted from its log.
   Start-up programs and compile seconds come from /metrics (`jhybrid:startup_programs_compiled`,
   `jhybrid:startup_compile_seconds`), else from a "N ... programs compiled in S s" log line, else "-".
3. Load, against the cached server, per concurrency c: `benchmarks.serve_load`'s request bodies and client
   (streaming /v1/completions, ignore_eos, greedy, ~`--prompt-tokens` tokens of prompt, `--max-tokens` new),
   max(4c, 32) requests after min(c, 8) warm-up ones, at most c in flight, under a deadline (requests still
   open then are cancelled and counted). The client runs in a process of its own (this one reads the servers'
   logs on threads, which would share its GIL), and reports where long gaps come from: tokens the server merged
   into one event, events read back to back, and its own event loop's lag. /metrics before and after (saved to the out folder): programs
   compiled after ready (`jhybrid:programs_compiled_after_ready_total`, expected 0), and the fresh XLA
   compiles the server's log shows meanwhile.
4. Offline, after the server has stopped: `jhybrid.LLM(DIR, max_num_seqs=64, max_model_len=2048)` (the
   server's engine settings, the same compilation cache) on the same request list with at most c requests
   in flight (a closed loop over `LLMEngine`, the offline twin of the client's semaphore), run twice per
   concurrency (the first pays for any compile; the loop is deterministic, so the second meets the same
   shapes); and the decode step at batch b = min(c, 64): b of the same prompts at once with max_tokens=N+1
   (N = --max-tokens), the median wall time of the engine steps in which all b rows decode (the engine
   dispatches a step before it reads the last one, so in steady state that is the device step plus any
   host time not hidden behind it); the JSON also has (t[max_tokens=N+1] - t[max_tokens=1]) / N.

Ratios printed (the issue's targets): server tok/s / offline tok/s (>= 0.85 at 64), server ITL P99 / offline
decode step at that batch (<= 1.5 at 64), server ITL P50 at 1 stream / offline batch-1 step (within 10%).
A machine line and a fixed-width table come last; `--out DIR`/serve_gpu.json (and `--json PATH`) hold
{machine_info, results}. Each subprocess runs in a process group of its own, dies with this process
(PR_SET_PDEATHSIG) and is killed on any exit of this one.

Wheels: `.whl/` (git-ignored: `/.whl/` in .git/info/exclude, so a copy of the work tree must carry it
explicitly) holds, for CPython 3.12 on x86-64 Linux, the serving packages the device image lacks, at the
versions of the development venv: fastapi 0.165.0, starlette 1.10.0, pydantic 2.14.4, pydantic-core 2.50.5,
typing-inspection 0.4.5, annotated-types 0.8.0, annotated-doc 0.0.7, opentelemetry-api 1.45.2 (fastapi
requires it), typing-extensions 4.16.0, uvicorn 0.54.0, h11 0.16.0, click 8.5.1, anyio 4.16.0, idna 3.20,
sniffio 1.3.1, prometheus-client 0.26.0, jinja2 3.1.6, markupsafe 3.0.4 (3.7 MB), each fetched with
`python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl
NAME==VERSION`. The install line above puts them in /tmp/site, first on PYTHONPATH (so they shadow any
copies in the image, consistently); the server and worker subprocesses inherit it.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import hashlib
import importlib.metadata
import json
import math
import multiprocessing
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.provenance import git_commit

REPO = Path(__file__).resolve().parents[1]

TINY_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, head_dim=16, num_attention_heads=4,
                   num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=16)
VOCAB = 4096  # the bundled tokenizer's
METRIC_STARTUP_PROGRAMS = "jhybrid:startup_programs_compiled"
METRIC_STARTUP_SECONDS = "jhybrid:startup_compile_seconds"
METRIC_AFTER_READY = "jhybrid:programs_compiled_after_ready_total"
STARTUP_LOG_RE = re.compile(r"(\d+)\s+(?:step\s+)?programs?\s+compiled\s+in\s+([0-9.]+)\s*s")
XLA_COMPILE_RE = "Finished XLA compilation of"  # JAX_LOG_COMPILES: each backend compile, cache loads included
CACHE_HIT_RE = "Persistent compilation cache hit for"
OWN_LOG_RE = re.compile(r"(INFO|WARNING|ERROR) jhybrid")  # the server's log format: "LEVEL logger: message"
LOG_CAP = 12 << 20  # bytes of each log file (the device run brings back files of up to 16 MiB)
# seconds each later phase keeps when an earlier one runs long (the whole run has --time-budget)
MIN_COLD, MIN_CACHED, MIN_LOAD, MIN_OFFLINE = 60, 60, 20, 120


def log(*a) -> None:
    print(*a, flush=True)


# ===================================================================================== subprocess handling
_CHILDREN: list["Child"] = []
_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def _die_with_parent() -> None:  # runs in the child between fork and exec: no imports, no allocation to speak of
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Child:
    """A subprocess in its own process group whose output goes, line by line and stamped with seconds since
    its start, to `log_path`; it counts XLA compiles and persistent-cache hits it sees in that output."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict | None = None, echo=False):
        self.cmd, self.log_path, self.echo = cmd, log_path, echo
        self.start = time.perf_counter()
        self.num_xla_compiles = self.num_cache_hits = 0
        self.lines: list[str] = []
        self.marks: list[str] = []  # the project's own log lines (not XLA's), stamped: where start-up time goes
        self._written = 0
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        _CHILDREN.append(self)
        self._file = open(log_path, "w", buffering=1, errors="replace")
        self._file.write("$ " + " ".join(cmd) + "\n")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            stamp = f"[{time.perf_counter() - self.start:8.2f}] "
            with self._lock:
                self.lines.append(line)
                if XLA_COMPILE_RE in line:
                    self.num_xla_compiles += 1
                if CACHE_HIT_RE in line:
                    self.num_cache_hits += 1
                if OWN_LOG_RE.match(line) and len(self.marks) < 200:
                    self.marks.append(stamp + line[:400])
            if len(line) > 2000:  # JAX_LOG_COMPILES lists every argument's shape
                line = line[:2000] + f" ... [{len(line) - 2000} more characters]"
            if self._written < LOG_CAP:
                self._file.write(stamp + line + "\n")
                self._written += len(line) + 12
                if self._written >= LOG_CAP:
                    self._file.write(f"[serve_gpu] log capped at {LOG_CAP} bytes; later lines only counted\n")
            if self.echo is True or (callable(self.echo) and self.echo(line)):
                print("   | " + line[-300:], flush=True)
        self._file.flush()

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self.num_xla_compiles, self.num_cache_hits

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float = 30.0) -> float:
        """SIGTERM to the group, SIGKILL after `grace` s; returns the seconds it took to exit."""
        t0 = time.perf_counter()
        if self.alive():
            self._signal(signal.SIGTERM)
            if self.wait(grace) is None:
                log(f"  pid {self.proc.pid}: no exit {grace:.0f} s after SIGTERM; SIGKILL")
                self._file.write(f"[serve_gpu] no exit {grace:.0f} s after SIGTERM: SIGKILL\n")
        self.kill()
        return time.perf_counter() - t0

    def kill(self) -> None:
        self._signal(signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        with contextlib.suppress(Exception):
            self._file.close()
        if self in _CHILDREN:
            _CHILDREN.remove(self)

    def _signal(self, sig) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def _kill_all(*_a) -> None:
    for child in list(_CHILDREN):
        with contextlib.suppress(Exception):
            child.kill()


def _on_signal(signum, _frame) -> None:
    _kill_all()
    raise SystemExit(128 + signum)


class Budget:
    """One overall deadline; a phase's timeout is its cap, cut so that later phases keep their minimums."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()

    def phase(self, cap: float, reserve: float = 0.0, floor: float = 10.0) -> float:
        """min(cap, time left - reserve), but at least `floor` while the budget lasts; never past the budget."""
        left = max(self.left(), 1.0)
        return min(cap, max(min(floor, left), left - reserve))


# ===================================================================================== worker: build
def worker_build(args) -> int:
    """Writes the HF checkpoint into args.model_dir and a calibration file (tokens per prompt word)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from benchmarks.generate import HF_CONFIG
    from benchmarks.serve_load import make_body
    from jhybrid.assets import default_model_path

    t0 = time.perf_counter()
    hf = dict(HF_CONFIG, vocab_size=VOCAB, eos_token_id=0, pad_token_id=0)
    if args.tiny:
        hf.update(TINY_CONFIG, max_position_embeddings=2048)
    out = Path(args.model_dir)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = Qwen3NextConfig(**hf)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Qwen3NextForCausalLM(cfg).state_dict().items()}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    tensors, num = {}, 0
    with torch.no_grad():
        for name, shape in shapes.items():
            if name.endswith("A_log"):  # decay rates exp(A) in [1, 16], as benchmarks/generate.py
                t = torch.empty(shape, device=device).uniform_(1, 16, generator=gen).log()
            elif name.endswith("dt_bias"):
                t = torch.empty(shape, device=device).uniform_(-1, 1, generator=gen)
            elif len(shape) == 1:  # (1 + w) norms near 0; the GDN gated norm (plain w) near 1
                t = torch.empty(shape, device=device).normal_(1.0 if "linear_attn.norm" in name else 0.0, 0.05,
                                                              generator=gen)
            else:
                t = torch.empty(shape, device=device, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)
            tensors[name] = t.to(torch.bfloat16).cpu().contiguous()
            num += t.numel()
    from safetensors.torch import save_file

    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    cfg_dict = json.loads(cfg.to_json_string(use_diff=False))
    cfg_dict.update(architectures=["Qwen3NextForCausalLM"], dtype="bfloat16", torch_dtype="bfloat16")
    (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model_path()) / f, tmp / f)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    from jhybrid.checkpoint_summary import summarize

    summary = summarize(str(out))  # raises on a missing / unexpected / mis-shaped tensor
    from jhybrid.tokenizer import load_tokenizer

    tok = load_tokenizer(str(out))
    rng, words, tokens = random.Random(12345), 0, 0
    ns = argparse.Namespace(prompt_words=100, max_tokens=1, model="m", temperature=0.0, chat=False)
    for i in range(64):
        text = make_body(i, ns, rng)[1]["prompt"]
        words += len(text.split())
        tokens += len(tok.encode(text))
    info = {"num_params": num, "bytes": os.path.getsize(out / "model.safetensors"), "tokens_per_word": tokens / words,
            "build_s": time.perf_counter() - t0, "device": device, "tiny": bool(args.tiny), "hf_config": hf}
    (out / "serve_gpu_build.json").write_text(json.dumps(info, indent=2))
    log(f"built {num / 1e9:.3f} B params ({info['bytes'] / 1e9:.2f} GB) on {device} in {info['build_s']:.1f} s; "
        f"{info['tokens_per_word']:.2f} tokens/word")
    log(summary.format().splitlines()[0] if hasattr(summary, "format") else "")
    return 0


# ===================================================================================== worker: offline
def all_decoding(sched) -> bool:
    """Whether the next step decodes only: rows running, none waiting, each with one token left to feed."""
    return bool(sched.running) and not sched.waiting and all(s.num_uncomputed <= 1 for s in sched.running)


def closed_loop(eng, prompts: list, c: int, params, tag: str, trace: bool = False) -> dict:
    """`prompts` (text or token ids) through the engine with at most `c` requests in flight (the offline twin of
    the load client): throughput, the per-request ITL as a client would see it, the median all-decode step and,
    with `trace`, the engine's step log and the runner's call log summarized (`benchmarks.step_trace`). Request
    ids are `tag`-i."""
    queue, inflight = list(enumerate(prompts)), {}
    step_times, n_out, n_prompt, first = [], 0, 0, None
    itls, seen = [], {}  # per request: time between successive output tokens, as a client would see them
    digest: dict[int, tuple] = {}
    if trace:
        eng.step_log, eng.runner.call_log = [], []
    start = last = time.perf_counter()
    while queue or inflight:
        while queue and len(inflight) < c:
            i, p = queue.pop(0)
            rid = f"{tag}-{i}"
            inflight[rid] = eng.add_request(rid, p, params)
        decode_only = all_decoding(eng.scheduler)
        eng.step()
        now = time.perf_counter()
        if decode_only:
            step_times.append(now - last)
        last = now
        for rid, seq in inflight.items():
            n = len(seq.output_ids)
            prev = seen.get(rid)
            if prev is None or n > prev[0]:
                if prev is not None and prev[0] > 0:
                    itls.append(now - prev[1])
                seen[rid] = (n, now)
        for rid, seq in list(inflight.items()):
            if seq.is_finished:
                if seq.error:
                    raise RuntimeError(f"offline request failed: {seq.error}")
                n_out += len(seq.output_ids)
                n_prompt += len(seq.prompt_ids)
                first = first or list(seq.output_ids[:16])
                digest[int(rid.rsplit("-", 1)[1])] = tuple(seq.output_ids)  # by prompt, not by this run's tag
                eng.release(rid)
                del inflight[rid]
    while eng.has_unfinished():
        eng.step()
    wall = time.perf_counter() - start
    steps = sorted(step_times)
    from benchmarks.serve_load import percentiles
    from benchmarks.step_trace import summarize

    extra = {"itl_s": percentiles(itls)}
    if eng.step_log is not None:
        from benchmarks.step_trace import summarize_calls

        extra["steps"] = summarize([list(r) for r in eng.step_log])
        extra["calls"] = summarize_calls([list(r) for r in eng.runner.call_log])
        eng.step_log = eng.runner.call_log = None
    return {**extra, "num_requests": len(prompts), "wall_s": wall, "output_tokens_per_s": n_out / wall,
            "num_output_tokens": n_out, "mean_prompt_tokens": n_prompt / max(1, len(prompts)),
            "inloop_decode_step_ms": steps[len(steps) // 2] * 1e3 if steps else float("nan"),
            "num_decode_steps": len(steps), "first_output_ids": first,
            "outputs_sha1": hashlib.sha1(repr(sorted(digest.items())).encode()).hexdigest()}


def worker_offline(args) -> int:
    """Offline baseline; reads a spec JSON, writes results to spec['out'] after every measurement."""
    spec = json.loads(Path(args.spec).read_text())
    out_path = Path(spec["out"])
    res: dict = {"runs": [], "steps": []}

    def save():
        out_path.write_text(json.dumps(res, indent=2))

    t0 = time.perf_counter()
    import jax

    import jhybrid
    from jhybrid.engine.sampling import SamplingParams

    res["device"] = jax.devices()[0].device_kind
    res["backend"] = jax.default_backend()
    extra = {}
    if spec.get("max_prefill_tokens_with_decodes") is not None:
        extra["max_prefill_tokens_with_decodes"] = spec["max_prefill_tokens_with_decodes"]
    llm = jhybrid.LLM(spec["model_dir"], max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"],
                      **extra)
    eng = llm.engine
    res["load_s"] = time.perf_counter() - t0
    log(f"offline: LLM ready in {res['load_s']:.1f} s on {res['device']}")
    save()
    texts, max_tokens = spec["prompts"], spec["max_tokens"]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    run_id = [0]

    def run(prompts: list[str], c: int) -> dict:
        run_id[0] += 1
        return closed_loop(eng, prompts, c, params, f"r{run_id[0]}", trace=bool(spec.get("step_log")))

    def batch_run(prompts: list[str], n: int) -> tuple[float, float]:
        """All of `prompts` at once with max_tokens=n: (wall s, median ms of the steps with every row decoding)."""
        run_id[0] += 1
        sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        seqs = [eng.add_request(f"b{run_id[0]}-{i}", p, sp) for i, p in enumerate(prompts)]
        step_times, start = [], time.perf_counter()
        last = start
        while eng.has_unfinished():
            full = all_decoding(eng.scheduler) and len(eng.scheduler.running) == len(prompts)
            eng.step()
            now = time.perf_counter()
            if full:
                step_times.append(now - last)
            last = now
        wall = time.perf_counter() - start
        for seq in seqs:
            if len(seq.output_ids) != n:
                raise RuntimeError(f"offline: an output of {len(seq.output_ids)} tokens, not {n} ({seq.finish_reason})")
            eng.release(seq.request_id)
        steps = sorted(step_times[2:] if len(step_times) > 6 else step_times)
        return wall, (steps[len(steps) // 2] * 1e3 if steps else float("nan"))

    for c, n in zip(spec["concurrencies"], spec["num_requests"]):
        prompts = texts[:n]
        for rep in ("warm-up", "timed"):
            r = run(prompts, c)
            log(f"offline c={c:4d} {rep:8s}: {r['output_tokens_per_s']:9.1f} tok/s, {n} requests in "
                f"{r['wall_s']:.2f} s, in-loop decode step {r['inloop_decode_step_ms']:.3f} ms, ITL p50/p99 "
                f"{r['itl_s']['p50'] * 1e3:.2f}/{r['itl_s']['p99'] * 1e3:.2f} ms")
        if r.get("steps"):
            log_steps(f"offline c={c:4d} steps", r["steps"])
            if r.get("calls"):
                log_calls(f"offline c={c:4d} calls", r["calls"])
        r["concurrency"] = c
        res["runs"].append(r)
        save()
    for b in spec["step_batches"]:
        prompts = texts[:b]
        batch_run(prompts, max_tokens + 1), batch_run(prompts, 1)  # warm-up (pays for any compile)
        tn, step = batch_run(prompts, max_tokens + 1)
        t1, _ = batch_run(prompts, 1)
        sub = (tn - t1) / max_tokens * 1e3
        log(f"offline batch {b:4d}: decode step {step:.3f} ms (median, all {b} rows decoding); "
            f"(t[{max_tokens + 1} tokens] {tn:.3f} s - t[1 token] {t1:.3f} s) / {max_tokens} = {sub:.3f} ms")
        res["steps"].append({"batch": b, "decode_step_ms": step, "decode_step_sub_ms": sub, "t_max_s": tn, "t_1_s": t1})
        save()
    res["total_s"] = time.perf_counter() - t0
    save()
    return 0


# ===================================================================================== server helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (OSError, ValueError):
        return 0, ""


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus exposition -> {name: value summed over label sets} (histogram buckets and _created dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+([^\s]+)", line)
        if not m or m.group(1).endswith(("_bucket", "_created")):
            continue
        with contextlib.suppress(ValueError):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def hist_quantiles(before: str, after: str, name: str, label: str = "") -> dict[str, float]:
    """P50/P90/P99 of a Prometheus histogram's observations between two scrapes (the upper edge of the bucket the
    quantile falls in; seconds); `label` (e.g. 'stage="server_queue"') keeps only the series that carry it."""
    def buckets(text):
        out: dict[float, float] = {}
        for m in re.finditer(rf'^{re.escape(name)}_bucket\{{([^}}]*)\}}\s+(\S+)$', text, re.M):
            if label not in m.group(1):
                continue
            le = float(re.search(r'le="([^"]+)"', m.group(1)).group(1))
            out[le] = out.get(le, 0.0) + float(m.group(2))
        return out

    b, e = buckets(before), buckets(after)
    edges = sorted(e)
    counts = [e[x] - b.get(x, 0.0) for x in edges]  # cumulative
    if not counts or counts[-1] <= 0:
        return {}
    return {f"p{q}": next(x for x, n in zip(edges, counts) if n >= counts[-1] * q / 100) for q in (50, 90, 99)}


def metric(m: dict[str, float] | None, name: str) -> float | None:
    if not m:
        return None
    for key in (name, name + "_total", name.removesuffix("_total")):
        if key in m:
            return m[key]
    return None


def scrape(port: int) -> dict[str, float] | None:
    status, text = http_get(port, "/metrics", timeout=10)
    return parse_metrics(text) if status == 200 else None


def serve_options(env: dict, timeout: float) -> set[str]:
    try:
        p = subprocess.run([sys.executable, "-m", "jhybrid.cli", "serve", "--help"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=timeout)
        return set(re.findall(r"--[a-z][a-z0-9-]+", p.stdout))
    except (OSError, subprocess.TimeoutExpired):
        return set()


@dataclasses.dataclass
class Startup:
    ok: bool
    seconds: float
    child: Child | None
    port: int
    xla_compiles: int = 0
    cache_hits: int = 0
    programs: float | None = None
    compile_s: float | None = None
    after_ready: float | None = None
    error: str = ""
    marks: list[str] = dataclasses.field(default_factory=list)  # the server's own log lines up to healthy


def start_server(label: str, cmd_tail: list[str], env: dict, out: Path, timeout: float, echo: bool) -> Startup:
    port = free_port()
    cmd = [sys.executable, "-m", "jhybrid.cli", "serve", *cmd_tail, "--port", str(port)]
    child = Child(cmd, out / f"server_{label}.log", env, echo=echo)
    t0, status = child.start, 0
    while time.perf_counter() - t0 < timeout and child.alive():
        status, _ = http_get(port, "/health", timeout=2)
        if status == 200:
            break
        time.sleep(0.1)
    seconds = time.perf_counter() - t0
    if status != 200:
        why = f"exited with {child.proc.returncode}" if not child.alive() else f"not healthy after {timeout:.0f} s"
        child.stop(grace=5)
        tail = " | ".join(child.lines[-5:])[-600:]
        st = Startup(False, seconds, None, port, error=f"{why}: {tail}")
        st.xla_compiles, st.cache_hits = child.counts()
        return st
    st = Startup(True, seconds, child, port)
    st.xla_compiles, st.cache_hits = child.counts()
    with child._lock:
        st.marks = list(child.marks)
    m = scrape(port)
    st.programs, st.compile_s, st.after_ready = (metric(m, METRIC_STARTUP_PROGRAMS), metric(m, METRIC_STARTUP_SECONDS),
                                                 metric(m, METRIC_AFTER_READY))
    if st.programs is None:
        for line in reversed(child.lines):
            if (hit := STARTUP_LOG_RE.search(line)) is not None:
                st.programs, st.compile_s = float(hit.group(1)), float(hit.group(2))
                break
    return st


# ===================================================================================== load
async def load_run(port: int, a: argparse.Namespace, deadline: float,
                   lags: list | None = None) -> tuple[list, float, int, list, float]:
    """serve_load's request list (same order of draws as its run_load) under a deadline: returns the
    finished results, the wall time, the number cancelled, the warm-up results and the perf_counter time the
    timed requests started at. `lags` gets how late this event loop ran a timer set LAG_PERIOD_S ahead, during
    the timed requests (the client's own share of the gaps it measures)."""
    from benchmarks.serve_load import make_body, one_request

    rng = random.Random(a.seed)
    requests = [make_body(i, a, rng) for i in range(a.num_requests)]
    warmup = [make_body(-1 - i, a, rng) for i in range(a.warmup_requests)]
    gate = asyncio.Semaphore(a.concurrency)
    done: list = []

    async def bounded(path, body, sink):
        async with gate:
            r = await one_request("127.0.0.1", port, path, body, None, a.timeout)
        sink.append(r)

    t0 = time.perf_counter()
    warm: list = []
    wtasks = [asyncio.ensure_future(bounded(p, b, warm)) for p, b in warmup]
    if wtasks:
        _, pending = await asyncio.wait(wtasks, timeout=max(1.0, deadline / 3))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    left = deadline - (time.perf_counter() - t0)
    start = time.perf_counter()
    monitor = asyncio.ensure_future(_watch_lag(lags)) if lags is not None else None
    tasks = [asyncio.ensure_future(bounded(p, b, done)) for p, b in requests]
    _, pending = await asyncio.wait(tasks, timeout=max(1.0, left))
    wall = time.perf_counter() - start
    if monitor is not None:
        monitor.cancel()
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return done, wall, len(pending), warm, start


def client_main(port: int, a: argparse.Namespace, timeout: float) -> tuple[tuple, list[float], float]:
    """`load_run` in a process of its own: (its result, the client loop's lags, the cores this process used)."""
    lags: list[float] = []
    c0, t0 = time.process_time(), time.perf_counter()
    out = asyncio.run(load_run(port, a, timeout, lags))
    return out, lags, (time.process_time() - c0) / (time.perf_counter() - t0)


LAG_PERIOD_S = 0.005
BACK_TO_BACK_S = 0.0005  # a gap this short between two events of one stream: they were read together


async def _watch_lag(out: list) -> None:
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + LAG_PERIOD_S
        await asyncio.sleep(LAG_PERIOD_S)
        out.append(max(0.0, loop.time() - due))


def wait_idle(port: int, timeout: float) -> bool:
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        m = scrape(port)
        busy = m is None or metric(m, "jhybrid:num_requests_running") or metric(m, "jhybrid:num_requests_waiting")
        if not busy:
            return True
        time.sleep(0.2)
    return False


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of each thread of process `pid` so far, with its name: {tid: (name, s)}."""
    tick = os.sysconf("SC_CLK_TCK")
    threads = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        threads[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return threads


def child_pids(pid: int) -> list[int]:
    """The direct children of process `pid` (the engine process of `jhybrid serve`)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            out += [int(x) for x in (task / "children").read_text().split()]
    return out


def thread_cpu_delta(pid: int, before: dict, after: dict, wall: float, top: int = 6) -> dict:
    """The server's busiest threads over a load: cores used by each (CPU seconds / wall), the main thread (the
    event loop under `jhybrid serve`) marked, and the whole process."""
    rows = []
    for tid, (name, sec) in after.items():
        used = sec - before.get(tid, (name, 0.0))[1]
        rows.append({"tid": tid, "name": ("main: " if tid == pid else "") + name, "cpu_s": used,
                     "cores": used / wall if wall else None})
    rows.sort(key=lambda r: -r["cpu_s"])
    total = sum(r["cpu_s"] for r in rows)
    return {"threads": rows[:top], "process_cores": total / wall if wall else None}


def load_phase(st: Startup, c: int, a: argparse.Namespace, timeout: float, out: Path) -> dict:
    from benchmarks.serve_load import percentiles, summarize

    port = st.port
    wait_idle(port, 30)
    before_text = http_get(port, "/metrics", 10)[1]
    before, (x0, h0) = parse_metrics(before_text), st.child.counts()
    pid = st.child.proc.pid
    engines = child_pids(pid)  # the engine process, when the engine runs in one
    cpu0, t0 = thread_cpu(pid), time.perf_counter()
    ecpu0 = {e: thread_cpu(e) for e in engines}
    # the client in a process of its own: here the servers' log readers would share its GIL and delay its reads
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        (results, wall, cancelled, warm, start), lags, client_cores = pool.submit(client_main, port, a, timeout).result()
    elapsed = time.perf_counter() - t0
    cpu = thread_cpu_delta(pid, cpu0, thread_cpu(pid), elapsed)
    cpu["engine_processes"] = [thread_cpu_delta(e, ecpu0[e], thread_cpu(e), elapsed) for e in engines]
    after_text = http_get(port, "/metrics", 10)[1]
    after, (x1, h1) = parse_metrics(after_text), st.child.counts()
    with open(out / "metrics.txt", "a") as f:  # one file: the device run brings back at most 8
        f.write(f"#### c={c} before the warm-up\n{before_text}\n#### c={c} after the load\n{after_text}\n")
    s = summarize(results, wall) if results else {"num_requests": 0, "num_errors": 0, "wall_s": wall,
                                                  "output_tokens_per_s": 0.0, "first_errors": []}
    s["num_cancelled"] = cancelled
    s["num_warmup_errors"] = sum(1 for r in warm if not r.ok)
    itls = [x for r in results if r.ok for x in r.itls]
    s["itl_max_s"] = max(itls) if itls else float("nan")
    # time per output token of each request, (e2e - TTFT) / (tokens - 1): not fooled by events arriving in bursts
    s["tpot_s"] = percentiles([(r.e2e - r.ttft) / (r.num_output_tokens - 1) for r in results
                               if r.ok and r.num_output_tokens > 1])
    s["num_gaps_over_1s"] = sum(1 for x in itls if x > 1.0)
    # where a long gap comes from: tokens the server sent merged into one event (its stream fell a step behind), or
    # events read back to back here (delayed between the server's write and this client's read)
    tokens = sum(r.num_output_tokens for r in results if r.ok)
    s["num_merged_tokens"] = tokens - sum(r.num_events for r in results if r.ok)
    s["num_back_to_back"] = sum(1 for x in itls if x < BACK_TO_BACK_S)
    s["num_itls"] = len(itls)
    s["client_loop_lag_s"] = percentiles(lags)

    def delta(name):
        b, e = metric(before, name), metric(after, name)
        return None if b is None or e is None else e - b

    s["after_ready_compiled"] = delta(METRIC_AFTER_READY)
    s["after_ready_total"] = metric(after, METRIC_AFTER_READY)
    s["xla_compiles"] = (x1 - x0) - (h1 - h0)  # fresh compiles during warm-up + load (cache hits excluded)
    s["xla_cache_hits"] = h1 - h0
    itl_sum = delta("jhybrid:inter_token_latency_seconds_sum")
    itl_count = delta("jhybrid:inter_token_latency_seconds_count")
    s["server_itl_mean_s"] = itl_sum / itl_count if itl_sum is not None and itl_count else None
    s["server_generation_tokens"] = delta("jhybrid:generation_tokens")
    s["preemptions"] = delta("jhybrid:num_preemptions")
    s["concurrency"], s["warmup_requests"] = c, a.warmup_requests
    s["window"] = [start, start + wall]  # perf_counter (CLOCK_MONOTONIC): slices the engine's step log (--step-log)
    s["server_itl_hist"] = hist_quantiles(before_text, after_text, "jhybrid:inter_token_latency_seconds")
    # where a token waits between the engine and the stream (histograms of the server process; warm-up included)
    s["delivery_hist"] = {stage: hist_quantiles(before_text, after_text, "jhybrid:output_delivery_seconds",
                                                f'stage="{stage}"') for stage in ("engine_to_server", "server_queue")}
    s["event_loop_lag_hist"] = hist_quantiles(before_text, after_text, "jhybrid:event_loop_lag_seconds")
    s["server_cpu"] = cpu  # warm-up included
    s["client_cores"] = client_cores
    log(f"[load] c={c}: client {client_cores:.2f} cores; server process {fmt(cpu['process_cores'])} cores; busiest threads " + ", ".join(
        f"{t['name']} {t['cores']:.2f}" for t in cpu["threads"][:4]))
    for e in cpu["engine_processes"]:
        log(f"[load] c={c}: engine process {fmt(e['process_cores'])} cores; busiest threads " + ", ".join(
            f"{t['name']} {t['cores']:.2f}" for t in e["threads"][:4]))
    s["metric_deltas"] = {k: after[k] - before[k] for k in sorted(after)
                          if k in before and after[k] != before[k] and not k.endswith("_total_created")}
    return s


# ===================================================================================== main
def fmt(x, spec=".1f", scale=1.0) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x * scale:{spec}}"


def gpu_name() -> str:
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                           timeout=20)
        return p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else "none"
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "none"


def version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for logs, metrics snapshots and serve_gpu.json "
                        "(default: a new temporary folder)")
    parser.add_argument("--json", metavar="PATH", help="also write {machine_info, results} here")
    parser.add_argument("--concurrency", default=None, help="comma-separated streams (default 1,16,64,256; tiny 1,4)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and workload, for a CPU smoke test")
    parser.add_argument("--model-dir", default=None,
                        help="checkpoint folder: reused when it holds one this script built (same --tiny), else built "
                        "there and kept (default: built in the temporary folder, deleted at the end)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="server and offline engine rows (default 64; tiny 8)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default 2048; tiny 512")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 64; tiny 16)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="mean prompt tokens (default 300; tiny 48)")
    parser.add_argument("--requests-per-stream", type=int, default=4, help="requests = max(this x c, --min-requests)")
    parser.add_argument("--min-requests", type=int, default=None, help="default 32; tiny 8")
    parser.add_argument("--max-warmup-requests", type=int, default=8, help="warm-up requests = min(c, this)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for the whole run (default 510; tiny 1500)")
    parser.add_argument("--serve-args", default="", help="extra `jhybrid serve` arguments, e.g. \"--no-warmup\"")
    parser.add_argument("--no-log-compiles", action="store_true", help="do not set JAX_LOG_COMPILES=1 for the server")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-cold", action="store_true",
                        help="start the server once (its start-up is labelled 'first'), not cold and then cached")
    parser.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None,
                        help="the engine option, for the server and the offline engine alike (default: the engine's)")
    parser.add_argument("--echo", action="store_true", help="echo the servers' output here too")
    parser.add_argument("--step-log", action="store_true",
                        help="record the served engine's step log (benchmarks/step_trace.py) and the offline one's, and "
                        "report the step intervals inside each load window: mixed (prompt-carrying) and decode-only "
                        "steps, the slowest steps; the offline closed loop's own ITL percentiles too")
    parser.add_argument("--worker", choices=("build", "offline"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.worker == "build":
        return worker_build(a)
    if a.worker == "offline":
        return worker_offline(a)

    tiny = a.tiny
    conc = [int(x) for x in (a.concurrency or ("1,4" if tiny else "1,16,64,256")).split(",") if x.strip()]
    max_num_seqs = a.max_num_seqs or (8 if tiny else 64)
    max_model_len = a.max_model_len or (512 if tiny else 2048)
    max_tokens = a.max_tokens or (16 if tiny else 64)
    prompt_tokens = a.prompt_tokens or (48 if tiny else 300)
    min_requests = a.min_requests or (8 if tiny else 32)
    budget = Budget(a.time_budget or (1500 if tiny else 510))
    if min(conc) < 1 or max_tokens < 1 or prompt_tokens < 1:
        parser.error("--concurrency, --max-tokens and --prompt-tokens must be positive")
    if prompt_tokens * 1.6 + max_tokens + 2 > max_model_len:
        parser.error(f"--prompt-tokens {prompt_tokens} (up to ~1.6x that) + --max-tokens must fit --max-model-len "
                     f"{max_model_len}")

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    work = Path(tempfile.mkdtemp(prefix="serve-gpu-"))
    out = Path(a.out) if a.out else work / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.txt").unlink(missing_ok=True)
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not any(Path(p).resolve() == REPO for p in paths if Path(p).exists()):
        paths.append(str(REPO))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    info = {"gpu": gpu_name(), "jax": version("jax"), "jaxlib": version("jaxlib"), "torch": version("torch"),
            "commit": git_commit(), "host": platform.node(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "fastapi": version("fastapi"), "uvicorn": version("uvicorn")}
    config = dict(concurrency=conc, max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_tokens=max_tokens,
                  prompt_tokens=prompt_tokens, tiny=tiny, serve_args=a.serve_args,
                  max_prefill_tokens_with_decodes=a.max_prefill_tokens_with_decodes)
    results: dict = {"config": config, "phases": {}, "load": [], "offline": None}
    t_all = time.perf_counter()

    def write_json():
        blob = json.dumps({"machine_info": info, "results": results}, indent=2, default=str)
        (out / "serve_gpu.json").write_text(blob)
        if a.json:
            Path(a.json).write_text(blob)

    log(f"serve_gpu: out {out}, work {work}, budget {budget.left():.0f} s")
    model_dir = Path(a.model_dir) if a.model_dir else work / "model"
    try:
        # ---------------------------------------------------------------- 1. build
        t0 = time.perf_counter()
        marker = model_dir / "serve_gpu_build.json"
        if not marker.exists() or json.loads(marker.read_text()).get("tiny") != tiny:
            log(f"[build] {'tiny' if tiny else '2.2 B'} checkpoint -> {model_dir}")
            cmd = [sys.executable, "-m", "benchmarks.serve_gpu", "--worker", "build", "--model-dir", str(model_dir)]
            child = Child(cmd + (["--tiny"] if tiny else []), out / "build.log", env, echo=True)
            limit = budget.phase(240, reserve=MIN_COLD + MIN_CACHED + MIN_LOAD * len(conc) + MIN_OFFLINE)
            rc = child.wait(limit)
            child.kill()
            if rc is None:  # the phases after it keep their reserves: a small --time-budget leaves the build seconds
                raise RuntimeError(f"the build did not finish in the {limit:.0f} s the --time-budget left it; build "
                                   f"first (`python -m benchmarks.serve_gpu --worker build --model-dir DIR`) and pass "
                                   f"--model-dir DIR, or give a larger --time-budget")
            if rc != 0:
                raise RuntimeError(f"the build failed (rc {rc}); see {out / 'build.log'}")
        else:
            log(f"[build] reusing {model_dir}")
        build = json.loads((model_dir / "serve_gpu_build.json").read_text())
        prompt_words = max(1, round(prompt_tokens / build["tokens_per_word"]))
        results["phases"]["build_s"] = time.perf_counter() - t0
        results["build"] = {k: build[k] for k in ("num_params", "bytes", "tokens_per_word", "device")}

        # ---------------------------------------------------------------- 2. start-up, cold and cached
        options = serve_options(env, budget.phase(60))
        cache_dir = work / "jax-cache"
        cache_dir.mkdir()
        (work / "xdg-cache").mkdir()
        env["XDG_CACHE_HOME"] = str(work / "xdg-cache")
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
        if not a.no_log_compiles:
            env["JAX_LOG_COMPILES"] = "1"
        tail = ["--model", str(model_dir), "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len)]
        cache_opts = sorted(o for o in options if re.fullmatch(r"--(jax-)?(compilation|compile)-cache-dir", o))
        if cache_opts:
            tail += [cache_opts[0], str(cache_dir)]
            cache_how = cache_opts[0]
        else:  # the engine has no cache option: JAX's own, told to keep every program
            env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
            cache_how = "JAX_COMPILATION_CACHE_DIR"
        tail += a.serve_args.split()
        step_logs = []
        if a.step_log:
            env["JHYBRID_ENGINE_SETUP"] = "benchmarks.step_trace:record"
        if a.max_prefill_tokens_with_decodes is not None:
            tail += ["--max-prefill-tokens-with-decodes", str(a.max_prefill_tokens_with_decodes)]
        config.update(cache=cache_how, serve_options=sorted(options))
        log(f"[serve] {' '.join(tail)} (cache via {cache_how})")
        starts = {}
        st = None
        for label in ("first",) if a.skip_cold else ("cold", "cached"):
            if a.step_log:
                env["JHYBRID_STEP_LOG"] = str(work / f"steps-{label}.json")
                step_logs.append(work / f"steps-{label}.json")
            later = ((MIN_CACHED if label == "cold" else 0) + MIN_LOAD * len(conc)
                     + (0 if a.skip_offline else MIN_OFFLINE))
            st = start_server(label, tail, env, out, budget.phase(300 if label == "cold" else 180, reserve=later,
                                                                 floor=MIN_CACHED), a.echo)
            entries = sum(1 for _ in cache_dir.rglob("*") if _.is_file())
            starts[label] = {"ok": st.ok, "seconds": st.seconds, "xla_compiles": st.xla_compiles - st.cache_hits,
                             "xla_cache_hits": st.cache_hits, "startup_programs": st.programs,
                             "startup_compile_s": st.compile_s, "after_ready": st.after_ready, "error": st.error,
                             "log": st.marks}
            for line in st.marks:
                if "start-up" in line or "loaded" in line.lower():
                    log(f"[serve] {label}: {line}")
            log(f"[serve] {label}: {'healthy' if st.ok else 'FAILED'} after {st.seconds:.1f} s; startup programs "
                f"{fmt(st.programs, '.0f')} in {fmt(st.compile_s)} s; XLA compiles {st.xla_compiles - st.cache_hits}, "
                f"cache hits {st.cache_hits}" + (f"; {st.error}" if st.error else ""))
            if label == "cold" and st.ok:
                starts[label]["stop_s"] = st.child.stop(grace=15)
                starts[label]["cache_entries"] = sum(1 for _ in cache_dir.rglob("*") if _.is_file())
                log(f"[serve] cold server stopped in {starts[label]['stop_s']:.1f} s; "
                    f"{starts[label]['cache_entries']} cache entries")
            elif label == "cold":
                starts[label]["cache_entries"] = entries
        results["startup"] = starts
        write_json()

        # ---------------------------------------------------------------- 3. load on the cached server
        if st is not None and st.ok:
            from benchmarks.serve_load import _first_model

            model_name = _first_model("127.0.0.1", st.port, None)
            reserve_offline = 0 if a.skip_offline else MIN_OFFLINE
            for i, c in enumerate(conc):
                n = max(a.requests_per_stream * c, min_requests)
                la = argparse.Namespace(model=model_name, api_key=None, num_requests=n, concurrency=c,
                                        max_tokens=max_tokens, prompt_words=prompt_words, temperature=0.0, chat=False,
                                        timeout=600.0, seed=0, warmup_requests=min(c, a.max_warmup_requests))
                later = len(conc) - i - 1
                timeout = budget.phase(120 if c < 64 else 150, reserve=reserve_offline + MIN_LOAD * later,
                                       floor=MIN_LOAD)
                la.timeout = timeout
                if not st.child.alive():
                    log(f"[load] c={c}: the server is gone (rc {st.child.proc.returncode}); stopping the load phase")
                    break
                log(f"[load] c={c}: {n} requests (+{la.warmup_requests} warm-up), deadline {timeout:.0f} s")
                s = load_phase(st, c, la, timeout, out)
                s["num_requests_planned"] = n
                results["load"].append(s)
                log(f"[load] c={c}: {s['output_tokens_per_s']:.1f} tok/s, {s['num_errors']} errors, "
                    f"{s['num_cancelled']} cancelled, TTFT p50 {fmt(s.get('ttft_s', {}).get('p50'), '.1f', 1e3)} ms, "
                    f"ITL p50/p99/max {fmt(s.get('itl_s', {}).get('p50'), '.2f', 1e3)}/"
                    f"{fmt(s.get('itl_s', {}).get('p99'), '.2f', 1e3)}/{fmt(s['itl_max_s'], '.1f', 1e3)} ms, "
                    f"compiled after ready {fmt(s['after_ready_compiled'], '.0f')} (XLA log {s['xla_compiles']}); "
                    f"server ITL histogram p50/p99 <= {fmt(s['server_itl_hist'].get('p50'), '.1f', 1e3)}/"
                    f"{fmt(s['server_itl_hist'].get('p99'), '.1f', 1e3)} ms")
                log(f"[load] c={c}: {s['num_merged_tokens']} tokens came merged into another's event, "
                    f"{s['num_back_to_back']} of {s['num_itls']} gaps < {BACK_TO_BACK_S * 1e3:.1f} ms (read together); "
                    f"client loop lag p50/p99 {fmt(s['client_loop_lag_s'].get('p50'), '.2f', 1e3)}/"
                    f"{fmt(s['client_loop_lag_s'].get('p99'), '.2f', 1e3)} ms")
                d = s["delivery_hist"]
                log(f"[load] c={c}: delivery p50/p99 <= engine->server {fmt(d['engine_to_server'].get('p50'), '.2f', 1e3)}/"
                    f"{fmt(d['engine_to_server'].get('p99'), '.2f', 1e3)} ms, server queue "
                    f"{fmt(d['server_queue'].get('p50'), '.2f', 1e3)}/{fmt(d['server_queue'].get('p99'), '.2f', 1e3)} ms; "
                    f"event-loop lag p50/p99 <= {fmt(s['event_loop_lag_hist'].get('p50'), '.2f', 1e3)}/"
                    f"{fmt(s['event_loop_lag_hist'].get('p99'), '.2f', 1e3)} ms")
                for e in s["first_errors"][:3]:
                    log(f"  error: {e}")
                write_json()
            results["server_log_stats"] = {"xla_compiles_total": st.child.counts()[0] - st.child.counts()[1]}
            results["phases"]["stop_s"] = st.child.stop(grace=15)
            if a.step_log:
                from benchmarks.step_trace import load, summarize, summarize_calls, summarize_gc

                path = step_logs[-1]
                steps, calls, collections = load(path) if path.exists() else ([], [], [])
                for s in results["load"]:
                    s["server_steps"] = summarize(steps, *s["window"])
                    s["server_calls"] = summarize_calls(calls, *s["window"])
                    s["server_gc"] = summarize_gc(collections, *s["window"])
                    log(f"[gc] engine process c={s['concurrency']}: " + ", ".join(
                        f"{g} {v['n']} passes" + (f" (max {v['max']:.1f} ms)" if v["n"] else "")
                        for g, v in s["server_gc"].items()))
                    log_steps(f"[steps] served c={s['concurrency']}", s["server_steps"])
                    log_calls(f"[calls] served c={s['concurrency']}", s["server_calls"])
                if not steps:
                    log(f"[steps] no step log at {path} (did the engine process exit normally?)")
        results["phases"]["server_s"] = time.perf_counter() - t0 - results["phases"]["build_s"]

        # ---------------------------------------------------------------- 4. offline
        if not a.skip_offline:
            t1 = time.perf_counter()
            from benchmarks.serve_load import make_body

            nmax = max(max(a.requests_per_stream * c, min_requests) for c in conc)
            ns = argparse.Namespace(model="m", max_tokens=max_tokens, prompt_words=prompt_words, temperature=0.0,
                                    chat=False)
            rng = random.Random(0)  # the load's seed: the same prompts, in the same order
            texts = [make_body(i, ns, rng)[1]["prompt"] for i in range(nmax)]
            spec = {"model_dir": str(model_dir), "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
                    "max_tokens": max_tokens, "prompts": texts, "concurrencies": conc,
                    "num_requests": [max(a.requests_per_stream * c, min_requests) for c in conc],
                    "step_batches": sorted({min(c, max_num_seqs) for c in conc}), "out": str(work / "offline.json"),
                    "max_prefill_tokens_with_decodes": a.max_prefill_tokens_with_decodes, "step_log": a.step_log}
            (work / "offline_spec.json").write_text(json.dumps(spec))
            timeout = budget.phase(600, floor=MIN_OFFLINE)
            log(f"[offline] {len(conc)} concurrencies + decode steps at batches {spec['step_batches']}, "
                f"timeout {timeout:.0f} s")
            off_env = {k: v for k, v in env.items() if k != "JAX_LOG_COMPILES"}
            child = Child([sys.executable, "-m", "benchmarks.serve_gpu", "--worker", "offline", "--spec",
                           str(work / "offline_spec.json")], out / "offline.log", off_env,
                          echo=lambda line: line.startswith(("offline", "Traceback", "RuntimeError", "Error")))
            rc = child.wait(timeout)
            child.kill()
            if rc != 0:
                log(f"[offline] {'timed out' if rc is None else f'failed (rc {rc})'}; partial results kept; "
                    f"see {out / 'offline.log'}")
            off_json = work / "offline.json"
            results["offline"] = json.loads(off_json.read_text()) if off_json.exists() else None
            if results["offline"] is not None:
                results["offline"]["rc"] = rc
                info["device"] = results["offline"].get("device", "?")
            results["phases"]["offline_s"] = time.perf_counter() - t1
    except Exception as e:  # noqa: BLE001 - whatever failed, report what was measured
        import traceback

        traceback.print_exc()
        results["error"] = f"{type(e).__name__}: {e}"
    finally:
        _kill_all()
        results["phases"]["total_s"] = time.perf_counter() - t_all
        results["ratios"] = ratios(results, max_num_seqs)
        write_json()
        if not a.model_dir:
            shutil.rmtree(model_dir, ignore_errors=True)
        if out == work / "out":  # the results stay in the temporary folder; the rest goes
            for p in work.iterdir():
                if p.is_dir() and p != out:
                    shutil.rmtree(p, ignore_errors=True)
                elif p.is_file():
                    p.unlink()
        else:
            shutil.rmtree(work, ignore_errors=True)
    report(info, results, out)
    if results.get("error"):
        log(f"error: {results['error']}")
    ok = not results.get("error") and all(s["num_errors"] == 0 and s["num_cancelled"] == 0 for s in results["load"])
    st = results.get("startup", {})
    ok = ok and (st.get("cached") or st.get("first") or {}).get("ok", False)
    return 0 if ok else 1


def log_steps(label: str, st: dict) -> None:
    if not st.get("num_steps"):
        log(f"{label}: no steps in the window")
        return
    for kind in ("all", "mixed", "decode"):
        iv = st[kind]["interval_ms"]
        if iv.get("n"):
            log(f"{label} {kind:6s}: {iv['n']:5d} steps, interval p50/p90/p99/max {iv['p50']:.2f}/{iv['p90']:.2f}/"
                f"{iv['p99']:.2f}/{iv['max']:.1f} ms; prepare+dispatch p50 {st[kind]['prepare_dispatch_ms']['p50']:.2f}, "
                f"device wait p50 {st[kind]['device_wait_ms']['p50']:.2f} ms; prompt tokens p50 "
                f"{st[kind]['prompt_tokens']['p50']:.0f}")
    log(f"{label} slowest: " + "; ".join(f"{x['interval_ms']:.1f} ms ({x['rows']} rows, {x['prompt_tokens']} prompt)"
                                         for x in st["slowest"][:5]))


def log_calls(label: str, st: dict) -> None:
    if not st.get("num_calls"):
        log(f"{label}: no program calls in the window")
        return
    for name, v in list(st["by_program"].items())[:8]:
        c, d = v["call_ms"], v["drain_wait_ms"]
        log(f"{label} {name:18s}: {c['n']:5d} calls, call p50/p99/max {c['p50']:.2f}/{c['p99']:.2f}/{c['max']:.1f} ms; "
            f"engine waited for the call before p50/p99 {d['p50']:.2f}/{d['p99']:.2f} ms")
    log(f"{label} slowest: " + "; ".join(
        f"{x['program']} {x['call_ms']:.1f} ms (after {x['previous']}, same program {x['same_program_calls_since']} "
        f"calls before)" for x in st["slowest"][:6]))


def ratios(results: dict, max_num_seqs: int) -> list[dict]:
    off = results.get("offline") or {}
    runs = {r["concurrency"]: r for r in off.get("runs", [])}
    steps = {s["batch"]: s["decode_step_ms"] for s in off.get("steps", [])}
    rows = []
    for s in results.get("load", []):
        c = s["concurrency"]
        r = runs.get(c)
        step = steps.get(min(c, max_num_seqs))
        itl = s.get("itl_s", {})
        row = {"concurrency": c, "server_tok_s": s["output_tokens_per_s"],
               "offline_tok_s": r["output_tokens_per_s"] if r else None, "offline_step_ms": step,
               "offline_inloop_step_ms": r["inloop_decode_step_ms"] if r else None}
        off_tps = r["output_tokens_per_s"] if r else None
        row["tok_s_ratio"] = s["output_tokens_per_s"] / off_tps if off_tps else None
        row["itl_p99_over_step"] = itl["p99"] * 1e3 / step if step and itl.get("p99") is not None else None
        row["itl_p50_over_step"] = itl["p50"] * 1e3 / step if step and itl.get("p50") is not None else None
        tpot = s.get("tpot_s", {}).get("p50")
        row["tpot_p50_over_step"] = tpot * 1e3 / step if step and tpot is not None else None
        rows.append(row)
    return rows


def report(info: dict, results: dict, out: Path) -> None:
    st = results.get("startup", {})
    log("")
    for label in ("cold", "cached", "first"):
        s = st.get(label)
        if s:
            log(f"start-up {label:6s}: {fmt(s['seconds'])} s to /health 200{'' if s['ok'] else ' (FAILED)'}; startup "
                f"programs {fmt(s['startup_programs'], '.0f')} in {fmt(s['startup_compile_s'])} s; XLA compiles "
                f"{s['xla_compiles']}, persistent-cache hits {s['xla_cache_hits']}; cache entries after "
                f"{s.get('cache_entries', '-')}")
    off = results.get("offline") or {}
    if off:
        log(f"offline: LLM ready in {fmt(off.get('load_s'))} s; mean prompt "
            f"{fmt((off.get('runs') or [{}])[0].get('mean_prompt_tokens'), '.0f')} tokens")
    ratios_by_c = {r["concurrency"]: r for r in results.get("ratios", [])}
    log(f"server logs: {out}/server_cold.log, {out}/server_cached.log; JSON: {out}/serve_gpu.json")
    log("table: TTFT / ITL in ms, client side; err = errors + requests cancelled at the deadline; ratio = server / "
        "offline tok/s at the same concurrency; step = offline decode step at batch min(c, max-num-seqs); p99/st, "
        "p50/st = server ITL over that step; TPOT = per request (e2e - TTFT) / (tokens - 1); srv ITL = mean of the "
        "server's own ITL histogram during the load; cmp = programs compiled after ready during warm-up + load "
        "(metric); xla = fresh XLA compiles in the server's log during warm-up + load")
    if (r := ratios_by_c.get(64)) is not None:
        log(f"c=64: tok/s ratio {fmt(r['tok_s_ratio'], '.2f')} (target >= 0.85); ITL p99 / step "
            f"{fmt(r['itl_p99_over_step'], '.2f')} (target <= 1.5)")
    if (r := ratios_by_c.get(1)) is not None:
        log(f"c=1: ITL p50 / batch-1 step {fmt(r['itl_p50_over_step'], '.2f')} (target 0.9 .. 1.1); TPOT p50 / "
            f"step {fmt(r['tpot_p50_over_step'], '.2f')}")
    log(f"start-up: cold {fmt(st.get('cold', {}).get('seconds'))} s (target <= 60), cached "
        f"{fmt(st.get('cached', {}).get('seconds'))} s (target <= 20); whole run "
        f"{fmt(results['phases'].get('total_s'))} s")
    log(f"machine: GPU {info['gpu']} ({info.get('device', '?')}) | jax {info['jax']} | commit {info['commit']} | "
        f"python {info['python']} | cpus {info['cpu_count']}")
    rows = []
    for s in results.get("load", []):
        r = ratios_by_c.get(s["concurrency"], {})
        tt, it = s.get("ttft_s", {}), s.get("itl_s", {})
        rows.append([("c", 4, str(s["concurrency"])), ("reqs", 5, str(s["num_requests"])),
                     ("err", 4, str(s["num_errors"] + s["num_cancelled"])),
                     ("srv tok/s", 10, fmt(s["output_tokens_per_s"])), ("off tok/s", 10, fmt(r.get("offline_tok_s"))),
                     ("ratio", 6, fmt(r.get("tok_s_ratio"), ".2f")),
                     ("TTFT p50", 9, fmt(tt.get("p50"), ".1f", 1e3)), ("p90", 8, fmt(tt.get("p90"), ".1f", 1e3)),
                     ("p99", 8, fmt(tt.get("p99"), ".1f", 1e3)), ("ITL p50", 8, fmt(it.get("p50"), ".2f", 1e3)),
                     ("p90", 7, fmt(it.get("p90"), ".2f", 1e3)), ("p99", 7, fmt(it.get("p99"), ".2f", 1e3)),
                     ("max", 8, fmt(s["itl_max_s"], ".1f", 1e3)),
                     ("TPOT p50", 9, fmt(s.get("tpot_s", {}).get("p50"), ".2f", 1e3)),
                     ("srv ITL", 8, fmt(s.get("server_itl_mean_s"), ".2f", 1e3)),
                     ("step ms", 8, fmt(r.get("offline_step_ms"), ".3f")),
                     ("p99/st", 7, fmt(r.get("itl_p99_over_step"), ".2f")),
                     ("p50/st", 7, fmt(r.get("itl_p50_over_step"), ".2f")),
                     ("cmp", 4, fmt(s["after_ready_compiled"], ".0f")), ("xla", 4, str(s["xla_compiles"]))])
    if rows:
        head = " ".join(f"{name:>{w}}" for name, w, _ in rows[0])
        log(head)
        log("-" * len(head))
        for row in rows:
            log(" ".join(f"{v:>{w}}" for _, w, v in row))
    else:
        log("(no load results)")

if __name__ == "__main__":
    sys.exit(main())
