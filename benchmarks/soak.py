"""Soak test of `jhybrid serve` on the CPU: a bounded mixed workload for a fixed time, with pass/fail gates.

    PYTHONPATH=. python -m benchmarks.soak [--duration 600 --clients 50] [--model-dir DIR] [--json PATH]

Starts `jhybrid serve` (the bundled model unless --model-dir, with a small chat template so that both
routes are exercised) as a subprocess on a free loopback port with CPU-sized engine settings, waits for
/health, then runs `--clients` client loops for `--duration` seconds. Each loop sends one request at a time,
of a kind drawn with fixed weights from a seeded generator, then pauses (think time, uniform in
[0, 2 x --think] seconds):

  valid      60%  completions or chat, streamed or not, n 1-2, greedy or sampled: must answer 200 with a
                  complete body (a stream ends with a finish_reason and [DONE])
  invalid    15%  malformed JSON, out-of-range fields (int32 overflow, NaN), wrong Content-Type, unknown model,
                  unsupported fields: must answer 4xx
  aborted    15%  a stream the client drops after its first events, or a request dropped after a moment
  oversized  10%  a body over --max-body-bytes, a prompt beyond the context, too many sequences: must answer 4xx

Every 5 s it samples the server's RSS (/proc/PID/status) and its /metrics gauges. When the time is up the
clients finish their current request; then it waits (up to 60 s) for the gauges to return to 0 and stops
the server with SIGTERM.

Gates (exit status 1 if any fails): no 5xx, transport error or timeout (--timeout) on a valid request; no
5xx on any other kind; RSS growth under 5% from the minute after --warmup-seconds (120) to the last minute
(medians of the 5-s samples: single samples move by a few % as the allocator breathes); running and waiting
requests, KV blocks and state slots back to 0; exit status 0 after SIGTERM. Prints a machine line and a
fixed-width table; `--json PATH` writes {machine_info, results}.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.serve_load import WORDS, _read_events, machine_info

KINDS = (("valid", 60), ("invalid", 15), ("aborted", 15), ("oversized", 10))
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_blocks_used", "state_slots_used")
COUNTERS = ("generation_tokens_total", "prompt_tokens_total")


class Server:
    """`jhybrid serve` in a subprocess; its log goes to `log_path`."""

    def __init__(self, model_dir: str, args, log_path: str):
        self.template = tempfile.NamedTemporaryFile("w", suffix=".jinja", delete=False)
        self.template.write(TEMPLATE)
        self.template.close()
        cmd = [sys.executable, "-m", "jhybrid.cli", "serve", "--model", model_dir, "--port", "0",
               "--served-model-name", "soak", "--chat-template", self.template.name, "--log-level", "info",
               "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-body-bytes", str(args.max_body_bytes),
               "--max-seqs-per-request", "8", "--shutdown-timeout", "10", *([] if args.warmup else ["--no-warmup"])]
        self.command = " ".join(cmd[2:])
        self.log = open(log_path, "w")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.log_path = log_path

    def wait_ready(self, timeout: float) -> tuple[str, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self.log_path}")
            with open(self.log_path) as f:
                m = re.search(r"running on http://([\d.]+):(\d+)", f.read())
            if m:
                return m.group(1), int(m.group(2))
            time.sleep(0.5)
        raise RuntimeError(f"the server did not start within {timeout:.0f} s; see {self.log_path}")

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) * 1024

    def stop(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9
        finally:
            self.log.close()
            os.unlink(self.template.name)


async def http(host: str, port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None, *,
               read_events: int | None = None, timeout: float = 120.0) -> tuple[int, str]:
    """One HTTP/1.1 exchange on a fresh connection: (status, body text). With `read_events`, the connection
    is dropped after that many server-sent events (status -1 if it ended first)."""

    async def run():
        reader, writer = await asyncio.open_connection(host, port)
        try:
            head = {"Host": f"{host}:{port}", "Content-Length": str(len(body)), "Connection": "close", **(headers or {})}
            writer.write(f"{method} {path} HTTP/1.1\r\n".encode()
                         + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode() + b"\r\n" + body)
            await writer.drain()
            status = int((await reader.readline()).split()[1])
            fields = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                key, _, value = line.decode().partition(":")
                fields[key.strip().lower()] = value.strip()
            chunked = "chunked" in fields.get("transfer-encoding", "")
            if "text/event-stream" in fields.get("content-type", ""):
                events = []
                async for data in _read_events(reader, chunked):
                    events.append(data)
                    if read_events is not None and len(events) >= read_events:
                        return -1, ""
                return status, "\n".join(events)
            return status, (await reader.read()).decode(errors="replace")
        finally:
            writer.close()

    return await asyncio.wait_for(run(), timeout)


def _json(body: dict) -> bytes:
    return json.dumps(body).encode()


JSON = {"Content-Type": "application/json"}


def make_request(kind: str, rng: random.Random, args) -> dict:
    """A request of `kind`: method, path, body, headers and what to check."""
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 24)))
    sampled = rng.random() < 0.5
    base = {"model": "soak", "max_tokens": rng.randint(4, 24), "n": rng.choice((1, 1, 1, 2)),
            **({"temperature": 0.8, "seed": rng.randrange(2**32)} if sampled else {"temperature": 0.0})}
    chat = rng.random() < 0.3
    path = "/v1/chat/completions" if chat else "/v1/completions"
    payload = {**base, "messages": [{"role": "user", "content": words}]} if chat else {**base, "prompt": words}
    if kind == "valid":
        stream = rng.random() < 0.5
        return {"path": path, "body": _json({**payload, "stream": stream}), "headers": JSON, "stream": stream}
    if kind == "aborted":
        if rng.random() < 0.7:
            return {"path": path, "body": _json({**payload, "max_tokens": 48, "stream": True}), "headers": JSON,
                    "read_events": rng.randint(1, 4)}
        return {"path": path, "body": _json({**payload, "max_tokens": 48}), "headers": JSON,
                "drop_after": rng.uniform(0.05, 1.0)}
    if kind == "invalid":
        choice = rng.randrange(8)
        bad = [
            (b'{"model": "soak", "prompt": ', JSON),
            (_json({**payload, "top_k": 2**40}), JSON),
            (_json(payload)[:-1] + b', "temperature": NaN}', JSON),
            (_json(payload), {"Content-Type": "text/plain"}),
            (_json({**payload, "model": "nope"}), JSON),
            (_json({**payload, "repetition_penalty": 1.5}), JSON),
            (_json({**payload, "logit_bias": {"99999999": 5}}), JSON),
            (_json({**payload, "max_tokens": -3}), JSON),
        ][choice]
        return {"path": path, "body": bad[0], "headers": bad[1], "expect_4xx": True}
    choice = rng.randrange(3)  # oversized
    if choice == 0:
        body = _json({**payload, "prompt": "x" * (args.max_body_bytes + 1024)})
    elif choice == 1:
        body = _json({"model": "soak", "prompt": "in the beginning " * args.max_model_len, "max_tokens": 4})
    else:
        body = _json({"model": "soak", "prompt": [words] * 20, "n": 2, "max_tokens": 4})
    return {"path": "/v1/completions", "body": body, "headers": JSON, "expect_4xx": True}


def _complete(status: int, text: str, req: dict) -> str | None:
    """Why a valid request's answer is not a complete 200 (None when it is)."""
    if status != 200:
        return f"HTTP {status}: {text[:200]}"
    if req.get("stream"):
        events = text.split("\n")
        if events[-1] != "[DONE]":
            return f"stream without [DONE]: {events[-2:]}"
        finishes = [c.get("finish_reason") for e in events[:-1] for c in json.loads(e).get("choices", [])]
        if not any(finishes) or any("error" in json.loads(e) for e in events[:-1]):
            return f"stream without a final event: {text[-200:]}"
        return None
    choices = json.loads(text).get("choices") or []
    if not choices or any(c.get("finish_reason") not in ("stop", "length") for c in choices):
        return f"incomplete body: {text[:200]}"
    return None


async def client_loop(i: int, host: str, port: int, deadline: float, args, stats: dict) -> None:
    rng = random.Random(args.seed * 1000 + i)
    kinds, weights = zip(*KINDS)
    while time.monotonic() < deadline:
        kind = rng.choices(kinds, weights)[0]
        req = make_request(kind, rng, args)
        t0 = time.monotonic()
        try:
            if "drop_after" in req:
                try:
                    await asyncio.wait_for(http(host, port, "POST", req["path"], req["body"], req["headers"]),
                                           req["drop_after"])
                    status, text = 200, ""
                except asyncio.TimeoutError:
                    status, text = -1, ""
            else:
                status, text = await http(host, port, "POST", req["path"], req["body"], req["headers"],
                                          read_events=req.get("read_events"), timeout=args.timeout)
        except Exception as e:  # noqa: BLE001 - counted: a transport error on a valid request fails the soak
            status, text = 0, f"{type(e).__name__}: {e}"
        stats["count"][kind, status] += 1
        if kind == "valid":
            stats["latency"].append(time.monotonic() - t0)
            problem = _complete(status, text, req)
            if problem:
                stats["valid_failures"].append(problem)
        elif req.get("expect_4xx") and not 400 <= status < 500:
            stats["other_failures"].append(f"{kind}: expected 4xx, got {status}: {text[:200]}")
        if status >= 500:
            stats["server_errors"] += 1
        await asyncio.sleep(rng.uniform(0, 2 * args.think))


def scrape(host: str, port: int) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^jhybrid:(\w+)(?:\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) in GAUGES + COUNTERS:
            out[m.group(1)] = float(m.group(2))
    return out


def sampler(server: Server, host: str, port: int, start: float, stop: threading.Event, samples: list) -> None:
    while not stop.wait(5.0):
        try:
            samples.append((time.monotonic() - start, server.rss_bytes(), scrape(host, port)))
        except Exception as e:  # noqa: BLE001
            samples.append((time.monotonic() - start, None, {"error": str(e)}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=None, help="checkpoint to serve (default: the bundled model)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--warmup-seconds", type=float, default=120.0, help="RSS growth is measured from here")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--think", type=float, default=1.0, help="mean pause of a client between requests (s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--max-body-bytes", type=int, default=65536)
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="pass --no-warmup to the server (programs then compile on first use)")
    parser.add_argument("--log", default="soak-server.log", help="the server's log (default soak-server.log)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.duration < args.warmup_seconds + 120:
        parser.error("--duration must exceed --warmup-seconds by at least 120 s (a minute to start from, one to end on)")

    from jhybrid.assets import default_model_path

    model_dir = args.model_dir or default_model_path()
    server = Server(model_dir, args, args.log)
    t_start = time.monotonic()
    host, port = server.wait_ready(timeout=1800)
    ready_s = time.monotonic() - t_start
    stats = {"count": collections.Counter(), "latency": [], "valid_failures": [], "other_failures": [],
             "server_errors": 0}
    samples: list = []
    stop = threading.Event()
    first = scrape(host, port)
    start = time.monotonic()
    watcher = threading.Thread(target=sampler, args=(server, host, port, start, stop, samples), daemon=True)
    watcher.start()

    async def load():
        deadline = time.monotonic() + args.duration
        await asyncio.gather(*(client_loop(i, host, port, deadline, args, stats) for i in range(args.clients)))

    asyncio.run(load())
    wall = time.monotonic() - start
    stop.set()
    watcher.join()
    settle_deadline, final = time.monotonic() + 60, {}
    while time.monotonic() < settle_deadline:
        final = scrape(host, port)
        if all(final.get(g, 1) == 0 for g in GAUGES):
            break
        time.sleep(0.5)
    exit_status = server.stop()

    rss = [(t, r) for t, r, _ in samples if r is not None]
    head = [r for t, r in rss if args.warmup_seconds <= t < args.warmup_seconds + 60]
    at_warm = statistics.median(head) if head else None
    tail = [r for t, r in rss if t >= wall - 60]
    end = statistics.median(tail) if tail else None
    growth = (end - at_warm) / at_warm if at_warm and end else float("nan")
    max_after = max((r for t, r in rss if t >= args.warmup_seconds), default=None)
    counts = stats["count"]
    valid = sum(v for (k, _), v in counts.items() if k == "valid")
    valid_5xx = sum(v for (k, s), v in counts.items() if k == "valid" and s >= 500)
    gauges_zero = all(final.get(g, 1) == 0 for g in GAUGES)
    gates = {
        "zero 5xx / transport errors / timeouts on valid requests": not stats["valid_failures"],
        "zero 5xx on any request": stats["server_errors"] == 0,
        "4xx where expected": not stats["other_failures"],
        "RSS growth < 5% after warm-up": growth < 0.05,
        "gauges back to 0": gauges_zero,
        "exit status 0 after SIGTERM": exit_status == 0,
    }
    lat = sorted(stats["latency"])
    tokens = final.get("generation_tokens_total", 0) - first.get("generation_tokens_total", 0)
    results = {
        "command": server.command, "duration_s": wall, "ready_s": ready_s, "clients": args.clients,
        "requests": {f"{k} {s}": v for (k, s), v in sorted(counts.items())},
        "num_requests": sum(counts.values()), "num_valid": valid, "num_valid_5xx": valid_5xx,
        "valid_failures": stats["valid_failures"][:10], "other_failures": stats["other_failures"][:10],
        "valid_latency_s": {f"p{q}": lat[min(len(lat) - 1, int(len(lat) * q / 100))] if lat else None
                            for q in (50, 90, 99, 100)},
        "generation_tokens_per_s": tokens / wall,
        "rss_mb": {"at_warmup": at_warm / 2**20 if at_warm else None, "end": end / 2**20 if end else None,
                   "max_after_warmup": max_after / 2**20 if max_after else None, "growth": growth},
        "final_gauges": final, "exit_status": exit_status, "gates": gates,
        "rss_samples_mb": [(round(t, 1), round(r / 2**20, 2)) for t, r in rss],
    }
    info = machine_info()
    print(" ".join(f"{k}={v}" for k, v in info.items()))
    print(f"server: {server.command}")
    print(f"ready after {ready_s:.1f} s; {args.clients} clients for {wall:.0f} s: {results['num_requests']} requests "
          f"({results['num_requests'] / wall:.1f}/s), {valid} valid (latency p50 {results['valid_latency_s']['p50'] or 0:.2f} s, "
          f"p99 {results['valid_latency_s']['p99'] or 0:.2f} s, max {results['valid_latency_s']['p100'] or 0:.2f} s); "
          f"{tokens / wall:.1f} generated tokens/s")
    print(f"{'kind':<12}{'status':>8}{'count':>10}")
    for (k, s), v in sorted(counts.items()):
        print(f"{k:<12}{s:>8}{v:>10}")
    r = results["rss_mb"]
    print(f"RSS: {r['at_warmup'] or 0:.1f} MiB in the minute after {args.warmup_seconds:.0f} s, {r['end'] or 0:.1f} MiB in the last "
          f"(growth {100 * growth:+.2f}%), max after warm-up {r['max_after_warmup'] or 0:.1f} MiB")
    print("final gauges: " + " ".join(f"{g}={final.get(g)}" for g in GAUGES) + f"; exit status {exit_status}")
    for name, ok in gates.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    for problem in stats["valid_failures"][:5] + stats["other_failures"][:5]:
        print(f"  {problem}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine_info": info, "results": results}, f, indent=2, default=str)
    return 0 if all(gates.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
