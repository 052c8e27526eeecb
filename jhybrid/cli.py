"""The `jhybrid` command line: generate, convert, inspect, serve.

Every subcommand returns an exit status; user errors (bad paths, inconsistent checkpoints, bad options)
print `error: ...` to stderr and return 2, without a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from typing import Any, Sequence

_DESCRIPTION = """\
jhybrid: a JAX inference engine for hybrid LLMs (full attention + Gated DeltaNet layers).

examples:
  jhybrid generate --prompt "And God said"          # the bundled 4.5 M-parameter model (KJV Bible)
  jhybrid convert ./Qwen3-Next-80B-A3B ./qwen3-next-jh --dtype bfloat16
  jhybrid inspect ./qwen3-next-jh
  jhybrid generate --model ./qwen3-next-jh --prompt "The capital of France is" --max-tokens 32
  jhybrid serve --model ./qwen3-next-jh --port 8000
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jhybrid", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    gen = sub.add_parser("generate", help="generate text from one or more prompts", description="Generate text from prompts.")
    gen.add_argument("--model", metavar="DIR", help="HF or converted checkpoint directory (default: the bundled model)")
    gen.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt; repeat for a batch")
    gen.add_argument(
        "--prompt-ids", action="append", default=[], metavar="IDS",
        help="a prompt as comma-separated token ids (e.g. 1,2,3), for checkpoints without a tokenizer; repeatable",
    )
    gen.add_argument("--max-tokens", type=int, default=64, metavar="N", help="new tokens per prompt (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default 0)")
    groups = _engine_options(gen, defaults=GENERATE_DEFAULTS,
                             none={"max_model_len": "the longest prompt + --max-tokens, rounded up to a power of two"})
    _multi_process_options(groups["parallelism"])
    gen.set_defaults(func=_generate)

    conv = sub.add_parser(
        "convert", help="convert an HF safetensors checkpoint to a jhybrid (orbax) checkpoint",
        description="Convert HF_DIR (config.json + safetensors) into OUT_DIR: config.json, jhybrid.json, an orbax "
        "params/ checkpoint and the tokenizer files. OUT_DIR appears only once complete.",
    )
    conv.add_argument("hf_dir", metavar="HF_DIR")
    conv.add_argument("out_dir", metavar="OUT_DIR")
    conv.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | float16 (default bfloat16)")
    conv.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    conv.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    conv.set_defaults(func=_convert)

    insp = sub.add_parser(
        "inspect", help="validate a checkpoint without running it",
        description="Validate an HF or converted checkpoint from its metadata (no weights are loaded): per-layer "
        "kinds, parameter counts, dtypes, KV-cache bytes per token and linear-state bytes per sequence. "
        "Exits non-zero on a missing, unexpected or mis-shaped tensor or an unsupported config. With "
        "--config-only, DIR may be a directory with a config.json or the file itself: parameters (total and "
        "active per token), bf16 and FP8 weight bytes, KV and state bytes, the fields ignored on purpose, and "
        "the smallest tensor-parallel size whose per-GPU weights fit one H200 with room for a KV pool.",
    )
    insp.add_argument("dir", metavar="DIR")
    insp.add_argument("--json", action="store_true", help="print the summary as JSON")
    insp.add_argument("--config-only", action="store_true",
                      help="read config.json alone (no weights needed): sizes, memory and tensor-parallel plan")
    insp.set_defaults(func=_inspect)

    srv = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over HTTP: POST /v1/completions and /v1/chat/completions (with \"stream\": true "
        "as server-sent events), GET /v1/models, /health and /metrics (Prometheus). Binds to 127.0.0.1 unless "
        "--host says otherwise.",
    )
    srv.add_argument("model_path", nargs="?", default=None, metavar="DIR",
                     help="HF or converted checkpoint directory (as `vllm serve DIR`; or --model DIR)")
    srv.add_argument("--model", default=None, metavar="DIR", help="the checkpoint directory, as a flag")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--api-key", default=None, metavar="KEY",
                     help="require `Authorization: Bearer KEY` on /v1 routes (default: $JHYBRID_API_KEY if set)")
    srv.add_argument("--served-model-name", default=None, metavar="NAME", help="the model's name in the API (default: DIR)")
    srv.add_argument("--chat-template", default=None, metavar="FILE",
                     help="a jinja chat template (file or text) instead of the checkpoint's")
    srv.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N", help="largest request body (default 1 MiB)")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    srv.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                     help="run the engine in a process of its own, beside the HTTP server's (default: on; off runs "
                     "it on a thread of the server process, where the two share one GIL: slower under load)")
    tools = srv.add_argument_group("tool calling")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let requests with tools use tool_choice "auto" (their default): the model decides when to '
                       "call, --tool-call-parser reads the calls from its output (default: off; such requests get 400)")
    tools.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="how the model writes tool calls: hermes (Qwen3, Qwen3-Next), qwen3_coder (Qwen3.5), "
                       "minimax (MiniMax-M1) (vLLM's names; default: none)")
    lim = srv.add_argument_group("limits and robustness")
    lim.add_argument("--max-seqs-per-request", type=int, default=128, metavar="N",
                     help="sequences one request may create, prompts x best_of (default 128, OpenAI's limit on n); "
                     "beyond it: 400")
    lim.add_argument("--max-waiting-requests", type=int, default=1024, metavar="N",
                     help="sequences waiting to run, queued included (default 1024); beyond it: 503 with Retry-After")
    lim.add_argument("--max-queued-tokens", type=int, default=1 << 20, metavar="N",
                     help="prompt tokens waiting to be prefilled (default 1048576); beyond it: 503 with Retry-After")
    lim.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                     help="on SIGTERM / SIGINT, seconds open requests have to finish before they are aborted "
                     "(each stream then ends with finish_reason \"abort\" and [DONE]); default 30")
    lim.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                     help="seconds for a request's headers to arrive (default 10); then 408 and the connection closes")
    lim.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                     help="seconds for a request's body to arrive (default 30); then 408")
    lim.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                     help="comma-separated origins whose web pages may call the API (CORS), or '*' for any; "
                     "default: none (CORS off)")
    groups = _engine_options(srv, defaults=SERVE_DEFAULTS)
    c = groups["compilation"]
    c.add_argument("--compilation-cache-dir", default=None, metavar="DIR",
                   help="JAX's persistent compilation cache, so a restart loads compiled programs from disk "
                   "(default: $JAX_COMPILATION_CACHE_DIR or ~/.cache/jhybrid/jax)")
    c.add_argument("--no-compilation-cache", action="store_true", help="do not read or write compiled programs on disk")
    srv.set_defaults(func=_serve)
    return parser


# The engine flags are EngineConfig's fields (`--max-num-seqs` for `max_num_seqs`), with their help metadata; these
# are the subcommands' own defaults where they differ from EngineConfig's (`jhybrid serve` compiles before serving).
GENERATE_DEFAULTS = dict(dtype=None, max_num_seqs=1)
SERVE_DEFAULTS = dict(dtype=None, max_num_seqs=64, warmup=True, enable_prefix_caching=True)


def _engine_options(parser: argparse.ArgumentParser, *, defaults: dict[str, Any],
                    none: dict[str, str] | None = None) -> dict[str, argparse._ArgumentGroup]:
    """Adds one flag per `EngineConfig` field, in argument groups by the field's `group` metadata, which it
    returns by name. `defaults` replace fields' defaults; `none` says what a None default means where the field's
    own `none` metadata does not fit this subcommand."""
    from jhybrid.engine.engine_config import EngineConfig

    groups: dict[str, argparse._ArgumentGroup] = {}
    types = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        meta = field.metadata
        group = groups.get(meta["group"]) or groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        default = defaults.get(field.name, field.default)
        shown = "%(default)s"
        if default is None:
            shown = (none or {}).get(field.name, meta["none"])
        elif isinstance(default, bool):
            shown = "on" if default else "off"
        kwargs = dict(default=default, help=f"{meta['help']} (default: {shown})")
        kind = _flag_type(types[field.name])
        if kind is bool:
            kwargs.update(action=argparse.BooleanOptionalAction)
        else:
            kwargs.update(type=kind, metavar=meta["metavar"], choices=meta["choices"])
        flags = ["--" + name.replace("_", "-") for name in (field.name, *meta["aliases"])]  # older names too
        group.add_argument(*flags, dest=field.name, **kwargs)
    return groups


def _flag_type(annotation: Any) -> type:
    """int, float, str or bool: the field's type without None."""
    kinds = [t for t in typing.get_args(annotation) or (annotation,) if t is not type(None)]
    assert len(kinds) == 1 and kinds[0] in (int, float, str, bool), annotation
    return kinds[0]


def _engine_config_options(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed engine flags as `EngineConfig` fields."""
    from jhybrid.engine.engine_config import OPTION_NAMES

    return {name: getattr(args, name) for name in OPTION_NAMES}


def _multi_process_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="multi-process run: address of process 0 (default: $JHYBRID_COORDINATOR); every process "
                   "runs the same command with its own --process-id")
    g.add_argument("--num-processes", type=int, default=None, metavar="N", help="processes in the run ($JHYBRID_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, default=None, metavar="I", help="this process, 0..N-1 ($JHYBRID_PROCESS_ID)")


def _generate(args: argparse.Namespace) -> int:
    from jhybrid.engine.engine_config import EngineConfig
    from jhybrid.parallel import init_distributed

    config = EngineConfig(**_engine_config_options(args))
    init_distributed(args.coordinator, args.num_processes, args.process_id)  # no-op without a coordinator
    if not args.model:
        from jhybrid.assets import default_model_path

        args.model = default_model_path()
    prompts: list = list(args.prompt)
    for text in args.prompt_ids:
        try:
            prompts.append([int(t) for t in text.split(",") if t.strip()])
        except ValueError:
            raise ValueError(f"--prompt-ids expects comma-separated integers, got {text!r}") from None
    if not prompts:
        raise ValueError("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    from jhybrid.model_loader import load
    from jhybrid.engine.llm import LLM, _bucket
    from jhybrid.engine.sampling import SamplingParams

    model = load(args.model, config.dtype, host=config.tensor_parallel_size > 1,
                 quantization=config.quantization, tensor_parallel_size=config.tensor_parallel_size)
    lengths = [len(model.tokenizer.encode(p)) if isinstance(p, str) and model.tokenizer else len(p) for p in prompts]
    context = model.cfg.max_position_embeddings
    if max(lengths) + args.max_tokens > context:
        raise ValueError(f"prompt ({max(lengths)} tokens) + --max-tokens ({args.max_tokens}) exceeds the model's context ({context})")
    max_model_len = config.max_model_len or min(context, _bucket(max(lengths) + args.max_tokens, minimum=64))
    llm = LLM(model, config, max_model_len=max_model_len)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=config.seed)
    for i, prompt in enumerate(prompts):
        if len(prompts) > 1:
            print(f"--- [{i}]", flush=True)
        _stream_one(llm, prompt, params, as_text=model.tokenizer is not None)
    return 0


def _stream_one(llm, prompt, params, *, as_text: bool) -> None:
    """Prints one generation as it comes: text deltas, or token ids for tokenizer-less checkpoints."""
    if as_text:
        for delta in llm.stream(prompt, params):
            print(delta, end="", flush=True)
        print(flush=True)
        return
    engine = llm.engine
    seq = engine.add_request(f"cli-{id(prompt)}", prompt, params)
    if seq.error:
        engine.release(seq.request_id)
        raise ValueError(seq.error)
    printed = 0
    try:
        while not seq.is_finished:
            engine.step()
            ids = seq.output_ids
            if len(ids) > printed:
                print(("" if printed == 0 else " ") + " ".join(str(t) for t in ids[printed:]), end="", flush=True)
                printed = len(ids)
        print(flush=True)
    finally:
        if not seq.is_finished:
            engine.abort(seq.request_id)
        while engine.has_unfinished():
            engine.step()
        engine.release(seq.request_id)


def _convert(args: argparse.Namespace) -> int:
    from converters import convert

    out = convert(args.hf_dir, args.out_dir, dtype=args.dtype, overwrite=args.overwrite, progress=not args.no_progress)
    print(f"wrote {out}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    if args.config_only:
        from jhybrid.config_summary import summarize_config as summarize
    else:
        from jhybrid.checkpoint_summary import summarize

    summary = summarize(args.dir)
    print(json.dumps(summary.to_json(), indent=2) if args.json else summary.format())
    return 0


def _serve(args: argparse.Namespace) -> int:
    import logging
    import os

    if args.model_path and args.model and args.model_path != args.model:
        raise ValueError(f"two models given: {args.model_path} and --model {args.model}; give one")
    args.model = args.model or args.model_path
    if not args.model:
        raise ValueError("no model given: jhybrid serve DIR (or --model DIR)")
    try:
        from jhybrid.server import serve
    except ImportError as e:
        raise ValueError(f"serving needs fastapi, uvicorn, prometheus-client and jinja2 ({e}): pip install -e .") from None
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65536), got {args.port}")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be positive, got {args.max_body_bytes}")
    for name in ("max_seqs_per_request", "max_waiting_requests", "max_queued_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("shutdown_timeout", "header_timeout", "body_timeout"):
        if not getattr(args, name) >= 0 or (name != "shutdown_timeout" and not getattr(args, name) > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {getattr(args, name)}")
    origins = tuple(o.strip() for o in (args.allowed_origins or "").split(",") if o.strip())
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    cache_dir = None
    if not args.no_compilation_cache:
        from jhybrid.engine.compilation import default_cache_dir

        cache_dir = args.compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR") or default_cache_dir()
    status = serve(
        args.model, host=args.host, port=args.port, api_key=args.api_key or os.environ.get("JHYBRID_API_KEY") or None,
        served_model_name=args.served_model_name, chat_template=args.chat_template, max_body_bytes=args.max_body_bytes,
        log_level=args.log_level, compilation_cache_dir=cache_dir, max_seqs_per_request=args.max_seqs_per_request,
        max_waiting_requests=args.max_waiting_requests, max_queued_tokens=args.max_queued_tokens,
        shutdown_timeout=args.shutdown_timeout, header_timeout=args.header_timeout, body_timeout=args.body_timeout,
        allowed_origins=origins, engine_process=args.engine_process, enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser, **_engine_config_options(args),
    )
    return status or 0  # 1 when the engine could not continue


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (0 ok, 2 user error). argparse usage errors exit 2 too."""
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except (OSError, ValueError, ImportError) as e:  # ConversionError is a ValueError
        msg = str(e) if not isinstance(e, ImportError) else f"generation engine unavailable: {e}"
        if isinstance(e, OSError) and e.filename and str(e.filename) not in msg:
            msg = f"{e.filename}: {msg}"
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
