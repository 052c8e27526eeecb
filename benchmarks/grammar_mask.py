"""Per-token mask time of the structured-output libraries on the CPU at a ~150k-token vocabulary (issue 19).

    PYTHONPATH=. python -m benchmarks.grammar_mask [--vocab 150000] [--json out.json]

No hub access: a byte-level BPE tokenizer of `--vocab` tokens is synthesised with `tokenizers` (pronounceable
words with and without a leading space, capitalised, digit runs, JSON punctuation runs, whitespace runs; each
token reached by merging its prefix with its last character). For each workload (a JSON schema, a regex) a fixed
valid answer is tokenised, then replayed token by token through each library's matcher: the time to fill that
position's bitmask (`[1, ceil(V/32)]` int32) is what is measured, and the answer's token must be allowed by the
mask (correctness gates speed: a library whose mask rejects a valid token is reported as failing). Also: the
grammar compile time (tokenizer set-up excluded) and, for llguidance, a batch of 16 rows filled in parallel
(`fill_next_token_bitmask_par`). Libraries that are not installed are skipped.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import tempfile
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 6},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "email", "tags", "address", "role"],
    "additionalProperties": False,
}
ANSWER = {"name": "Ada Lovelace of the Analytical Engine", "age": 36, "email": "ada@engine.org",
          "tags": ["mathematics", "poetry", "computing", "notes"], "address": {"city": "London", "zip": "W1 1AA"},
          "role": "admin"}
REGEX = r"(\+\d{1,3} )?\(\d{3}\) \d{3}-\d{4}( ext\. \d{1,5})?, [A-Z][a-z]+ [A-Z][a-z]+"
REGEX_ANSWER = "+44 (020) 794-6000 ext. 1234, Charles Babbage"


def synth_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE `tokenizers.Tokenizer` of exactly `vocab_size` tokens (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = pre_tokenizers.ByteLevel.alphabet()  # the 256 byte symbols
    space = "\u0120"  # byte-level ' '
    rng = np.random.default_rng(seed)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab: dict[str, int] = {}
    merges: list[tuple[str, str]] = []
    for s in specials + sorted(byte_chars):
        vocab.setdefault(s, len(vocab))

    def add(word: str) -> None:
        for k in range(2, len(word) + 1):
            piece = word[:k]
            if piece not in vocab:
                if len(vocab) >= vocab_size:
                    return
                merges.append((word[: k - 1], word[k - 1]))
                vocab[piece] = len(vocab)

    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "y", "z",
              "br", "ch", "cl", "cr", "dr", "fl", "gr", "pl", "pr", "sh", "sl", "sp", "st", "str", "th", "tr", "wh"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "ie", "oo", "ou", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "th", "rd", "ll", "ss", "x"]
    punct = ['{"', '":', '",', '"}', "},", "}]", "[{", '":"', '":[', '":{', '","', "],", ", ", ": ", "...", "--",
             "//", "();", "{}", "[]", "=>", "!=", "==", "<=", ">=", "\u010a", "\u010a\u010a", "\u0109"]
    for p in punct:
        add(p.replace(" ", space))
    for n in range(1000):  # digit runs of up to three digits, as most tokenizers have
        add(str(n))
    for k in range(2, 33):  # runs of spaces (code indentation)
        add(space * k)
        add("\u010a" + space * k)
    while len(vocab) < vocab_size:
        word = "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                       for _ in range(int(rng.integers(1, 4))))
        r = rng.random()
        if r < 0.25:
            word = word.capitalize()
        if rng.random() < 0.55:
            word = space + word
        elif rng.random() < 0.1:
            word = '"' + word
        add(word)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size, tok.get_vocab_size(with_added_tokens=True)
    return tok


def _stats(times_us: list[float]) -> dict:
    a = np.asarray(times_us)
    return dict(median_us=float(np.median(a)), p20_us=float(np.percentile(a, 20)), p80_us=float(np.percentile(a, 80)),
                mean_us=float(a.mean()), max_us=float(a.max()), tokens=len(a))


def _allowed(mask_row: np.ndarray, token: int) -> bool:
    return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


def run_llguidance(tok, vocab: int, eos: int, workloads: dict) -> dict:
    import llguidance
    import llguidance.numpy as lnp

    t0 = time.perf_counter()
    ll_tok = llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab, eos_token=eos)
    out = {"tokenizer_setup_s": time.perf_counter() - t0}
    for name, (kind, spec, ids) in workloads.items():
        grammar = (llguidance.LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
                   if kind == "json" else llguidance.LLMatcher.grammar_from_regex(spec))
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
        compile_s = time.perf_counter() - t0
        if matcher.is_error():
            out[name] = dict(error=matcher.get_error())
            continue
        mask = lnp.allocate_token_bitmask(1, vocab)
        times, ok = [], True
        for t in ids + [eos]:
            t1 = time.perf_counter_ns()
            lnp.fill_next_token_bitmask(matcher, mask, 0)
            times.append((time.perf_counter_ns() - t1) / 1e3)
            ok &= _allowed(mask[0], t) and matcher.consume_token(t)
        res = dict(_stats(times), compile_ms=compile_s * 1e3, correct=bool(ok and matcher.is_stopped()))
        # 16 rows at once, each at a different position of the answer, filled in parallel
        executor = llguidance.LLExecutor()
        rows = []
        for i in range(16):
            m = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
            m.consume_tokens(ids[: (i * len(ids)) // 16])
            rows.append((m, i))
        batch = lnp.allocate_token_bitmask(16, vocab)
        reps = []
        for _ in range(20):
            t1 = time.perf_counter_ns()
            lnp.fill_next_token_bitmask_par(executor, rows, batch)
            reps.append((time.perf_counter_ns() - t1) / 1e3)
        res["batch16_par_median_us"] = float(np.median(reps))
        out[name] = res
    return out


def run_xgrammar(tok, vocab: int, eos: int, workloads: dict) -> dict:
    import torch
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    out = {"tokenizer_setup_s": time.perf_counter() - t0}
    for name, (kind, spec, ids) in workloads.items():
        t0 = time.perf_counter()
        compiled = (compiler.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(",", ":")) if kind == "json"
                    else compiler.compile_regex(spec))
        compile_s = time.perf_counter() - t0
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, vocab)
        times, ok = [], True
        for t in ids + [eos]:
            t1 = time.perf_counter_ns()
            matcher.fill_next_token_bitmask(mask, 0)
            times.append((time.perf_counter_ns() - t1) / 1e3)
            ok &= _allowed(mask[0].numpy(), t) and matcher.accept_token(t)
        out[name] = dict(_stats(times), compile_ms=compile_s * 1e3, correct=bool(ok and matcher.is_terminated()))
    return out


def machine_info() -> dict:
    from benchmarks.provenance import git_commit

    commit = git_commit()
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = {}
    for lib in ("llguidance", "xgrammar", "tokenizers"):
        try:
            versions[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            versions[lib] = None
    return dict(cpu=cpu, cores=os.cpu_count(), python=platform.python_version(), commit=commit, **versions,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=150_000)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    info = machine_info()
    print("machine:", ", ".join(f"{k}={v}" for k, v in info.items()))
    t0 = time.perf_counter()
    tok = synth_tokenizer(args.vocab)
    print(f"synthesised a {args.vocab}-token byte-level BPE tokenizer in {time.perf_counter() - t0:.1f} s")
    eos = tok.token_to_id("<|endoftext|>")
    answer = json.dumps(ANSWER, separators=(",", ":"))
    workloads = {"json_schema": ("json", SCHEMA, tok.encode(answer).ids),
                 "regex": ("regex", REGEX, tok.encode(REGEX_ANSWER).ids)}
    results = {}
    for lib, fn in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar)):
        try:
            __import__(lib)
        except ImportError:
            print(f"{lib}: not installed, skipped")
            continue
        results[lib] = fn(tok, args.vocab, eos, workloads)
    print(f"\n{'library':<11} {'workload':<12} {'tokens':>6} {'median us':>10} {'p20':>8} {'p80':>8} {'mean':>8} "
          f"{'max':>9} {'compile ms':>11} {'16 rows par us':>15} correct")
    for lib, res in results.items():
        for name in workloads:
            r = res[name]
            if "error" in r:
                print(f"{lib:<11} {name:<12} error: {r['error']}")
                continue
            par = f"{r['batch16_par_median_us']:.0f}" if "batch16_par_median_us" in r else "-"
            print(f"{lib:<11} {name:<12} {r['tokens']:>6} {r['median_us']:>10.1f} {r['p20_us']:>8.1f} "
                  f"{r['p80_us']:>8.1f} {r['mean_us']:>8.1f} {r['max_us']:>9.1f} {r['compile_ms']:>11.1f} {par:>15} "
                  f"{r['correct']}")
        print(f"{lib:<11} tokenizer set-up {res['tokenizer_setup_s']:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine_info": info, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
