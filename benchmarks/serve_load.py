"""Bounded load generator for `jhybrid serve`: a fixed number of streaming requests over loopback.

    PYTHONPATH=. python -m benchmarks.serve_load --url http://127.0.0.1:8000 [--num-requests 200 --concurrency 32]
    PYTHONPATH=. python -m benchmarks.serve_load --model-dir DIR [...]     # starts its own server on 127.0.0.1

After `--warmup-requests` unmeasured requests (they pay for XLA compilation), it sends `--num-requests`
streaming requests (completions, or chat with `--chat`), at most `--concurrency`
at a time, each with a random prompt of about `--prompt-words` words (fixed seed) and `--max-tokens`
new tokens (EOS ignored), then stops. Only loopback addresses are accepted. Each request has a timeout, so
the run always ends.

Reported: requests/s and output tokens/s over the wall time, P50/P90/P99 of time to first token, inter-token
latency (gap between successive content events) and end-to-end latency, and the error count, as a
fixed-width table; `--json PATH` writes {machine_info, results}. The client is plain asyncio (no HTTP
library), so it costs little CPU next to the server it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import random
import sys
import time
import urllib.parse

import numpy as np

WORDS = ("the quick brown fox jumps over lazy dog model layer state token attention linear full hybrid cache "
         "block slot engine paris rome capital small time once upon there was").split()


@dataclasses.dataclass
class Result:
    ok: bool
    ttft: float = float("nan")
    itls: list[float] = dataclasses.field(default_factory=list)
    e2e: float = float("nan")
    num_output_tokens: int = 0
    error: str = ""
    num_prompt_tokens: int = 0  # from the final usage event (stream_options.include_usage)
    num_cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens (prefix caching)
    token_ids: list[int] = dataclasses.field(default_factory=list)  # with logprobs, on a server without tokenizer
    num_events: int = 0  # events that carried output (fewer than the tokens when the server merged deltas)


async def _read_events(reader: asyncio.StreamReader, chunked: bool):
    """Yields SSE `data:` payloads from an HTTP/1.1 body (chunked or read to EOF)."""
    buffer = b""

    async def pieces():
        if not chunked:
            while chunk := await reader.read(65536):
                yield chunk
            return
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)

    async for piece in pieces():
        buffer += piece
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    yield line[6:].decode()


async def one_request(host: str, port: int, path: str, body: dict, api_key: str | None, timeout: float) -> Result:
    start = time.perf_counter()
    payload = json.dumps(body).encode()
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n{auth}\r\n")

    async def run() -> Result:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(head.encode() + payload)
            await writer.drain()
            status = int((await reader.readline()).split()[1])
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                key, _, value = line.decode().partition(":")
                headers[key.strip().lower()] = value.strip()
            chunked = "chunked" in headers.get("transfer-encoding", "")
            if status != 200:
                text = "".join([e async for e in _read_events(reader, chunked)]) or (await reader.read())[:200].decode()
                return Result(False, error=f"HTTP {status}: {text[:200]}")
            res, last = Result(True), None
            async for data in _read_events(reader, chunked):
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return Result(False, error=event["error"].get("message", "error event"))
                if usage := event.get("usage"):
                    res.num_output_tokens, res.num_prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
                    res.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                for choice in event.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    tokens = (choice.get("logprobs") or {}).get("tokens") or []  # completions' logprobs
                    res.token_ids += [int(t[9:]) for t in tokens if t.startswith("token_id:")]
                    if text or tokens:
                        now = time.perf_counter()
                        res.num_events += 1
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itls.append(now - last)
                        last = now
            res.e2e = time.perf_counter() - start
            return res
        finally:
            writer.close()

    try:
        return await asyncio.wait_for(run(), timeout)
    except Exception as e:  # noqa: BLE001 - every failure is counted, none stops the run
        return Result(False, error=f"{type(e).__name__}: {e}")


def make_body(i: int, args, rng: random.Random) -> tuple[str, dict]:
    text = " ".join(rng.choice(WORDS) for _ in range(max(1, int(rng.gauss(args.prompt_words, args.prompt_words / 4)))))
    body = {"model": args.model, "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": args.temperature, "seed": i % 2**32}
    if args.chat:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**body, "prompt": text}


async def run_load(host: str, port: int, args) -> tuple[list[Result], float]:
    """Warm-up requests (not reported: they pay for compilation), then the measured ones."""
    rng = random.Random(args.seed)
    requests = [make_body(i, args, rng) for i in range(args.num_requests)]
    gate = asyncio.Semaphore(args.concurrency)

    async def bounded(path, body):
        async with gate:
            return await one_request(host, port, path, body, args.api_key, args.timeout)

    warmup = [make_body(-1 - i, args, rng) for i in range(args.warmup_requests)]
    await asyncio.gather(*(bounded(p, b) for p, b in warmup))
    start = time.perf_counter()
    results = await asyncio.gather(*(bounded(p, b) for p, b in requests))
    return results, time.perf_counter() - start


def percentiles(values: list[float]) -> dict[str, float]:
    v = np.asarray([x for x in values if np.isfinite(x)], np.float64)
    if v.size == 0:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    return {f"p{q}": float(np.percentile(v, q)) for q in (50, 90, 99)}


def summarize(results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    return {
        "num_requests": len(results), "num_errors": len(errors), "wall_s": wall,
        "requests_per_s": len(ok) / wall, "output_tokens_per_s": sum(r.num_output_tokens for r in ok) / wall,
        "ttft_s": percentiles([r.ttft for r in ok]), "itl_s": percentiles([x for r in ok for x in r.itls]),
        "e2e_s": percentiles([r.e2e for r in ok]), "first_errors": errors[:5],
    }


def print_table(s: dict) -> None:
    print(f"{s['num_requests']} requests, {s['num_errors']} errors, {s['wall_s']:.2f} s: "
          f"{s['requests_per_s']:.2f} req/s, {s['output_tokens_per_s']:.1f} output tok/s")
    print(f"{'metric':<22}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}")
    for label, key in (("time to first token", "ttft_s"), ("inter-token latency", "itl_s"), ("end to end", "e2e_s")):
        p = s[key]
        print(f"{label:<22}{p['p50'] * 1e3:>10.1f}{p['p90'] * 1e3:>10.1f}{p['p99'] * 1e3:>10.1f}")
    for e in s["first_errors"]:
        print(f"  error: {e}")


def machine_info() -> dict:
    from benchmarks.provenance import git_commit

    return {"host": platform.node(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "commit": git_commit()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000 (loopback only)")
    target.add_argument("--model-dir", help="start a server for this checkpoint on 127.0.0.1 first")
    parser.add_argument("--model", default=None, help="model name in requests (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-requests", type=int, default=None,
                        help="unmeasured requests sent first (default: --concurrency)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="with --model-dir: engine rows")
    parser.add_argument("--max-model-len", type=int, default=None, help="with --model-dir")
    parser.add_argument("--dtype", default=None, help="with --model-dir")
    parser.add_argument("--json", metavar="PATH", help="write {machine_info, results} here")
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        parser.error("--num-requests, --concurrency and --max-tokens must be positive")
    if args.warmup_requests is None:
        args.warmup_requests = args.concurrency

    from jhybrid.server.launch import is_loopback

    server = engine = None
    if args.model_dir:
        from jhybrid.server import BackgroundServer, ServerConfig, build_engine, create_app, load_chat_template

        name = args.model or os.path.basename(os.path.normpath(args.model_dir))
        engine = build_engine(args.model_dir, dtype=args.dtype, served_model_name=name, max_num_seqs=args.max_num_seqs,
                              max_model_len=args.max_model_len)
        config = ServerConfig(model_names=(name,), chat_template=load_chat_template(args.model_dir), api_key=args.api_key)
        server = BackgroundServer(create_app(engine, config)).start()
        args.url = server.url
    url = urllib.parse.urlsplit(args.url)
    if not is_loopback(url.hostname or ""):
        parser.error(f"--url must be a loopback address (127.0.0.1, ::1, localhost), got {url.hostname!r}")
    host, port = url.hostname, url.port or 80
    try:
        if args.model is None:
            args.model = _first_model(host, port, args.api_key)
        results, wall = asyncio.run(run_load(host, port, args))
    finally:
        if server is not None:
            server.stop()
            engine.shutdown()
    summary = summarize(results, wall)
    info = machine_info()
    print(" ".join(f"{k}={v}" for k, v in info.items()))
    print_table(summary)
    config = {k: getattr(args, k) for k in ("num_requests", "concurrency", "max_tokens", "prompt_words", "chat", "temperature",
                                            "warmup_requests")}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine_info": info, "results": {"config": config, **summary}}, f, indent=2)
    return 0 if summary["num_errors"] == 0 else 1


def _first_model(host: str, port: int, api_key: str | None) -> str:
    import urllib.request

    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    req = urllib.request.Request(f"http://{netloc}/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)["data"][0]["id"]


if __name__ == "__main__":
    sys.exit(main())
