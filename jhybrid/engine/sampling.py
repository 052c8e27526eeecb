"""Sampling parameters (validated on the host) and the sampler that runs inside the jitted step.

Every setting is a runtime array of the step, so one compiled program serves any mix of greedy, sampled,
filtered (top-k / top-p / min-p), biased, penalised, restricted and log-probability requests; work that no row
of a step needs (drawing, sorting for top-k / top-p, the top log-probabilities, penalties, banned tokens, the
allowed-token mask) is skipped by `lax.cond` on the device. The per-request tables (logit bias, banned token
sequences, allowed tokens, token counts for penalties) live per state slot: `jhybrid.engine.slot_tables`.

The order is vLLM's (v1 sampler): logit bias, the structured-output grammar bitmask (`jhybrid.engine.structured_output`), allowed tokens and
banned ones (bad words; EOS and stop token ids before `min_tokens`), then presence / frequency / repetition penalties; greedy rows take the argmax of that,
sampled rows divide by the temperature, drop tokens below `min_p` of the most likely one, then top-k / top-p.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries of `logit_bias` per request (the step holds this many per state slot)
INT32_MAX = 2**31 - 1
MAX_N = 128  # completions (n) and candidates (best_of) per request, OpenAI's limit on `n`
MAX_BANS = 128  # banned token sequences per request: bad words (each with and without a leading space) + stop ids
MAX_BAN_TOKENS = 8  # tokens of one bad word (its last token is banned after the others)
FLAG_PENALTIES, FLAG_BANS, FLAG_ALLOWED = 1, 2, 4  # `SamplingArrays.flags`: what a row uses
FLAG_MASKED = 8  # the row reads its row of the step's grammar bitmask (structured output)
FLAG_BIAS = 16  # the row has a logit bias (its slot's bias rows; a slot without one holds zeros)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one request. `temperature == 0` is greedy.

    Attributes:
      max_tokens: new tokens to generate at most.
      temperature: softmax temperature; 0 means greedy (argmax).
      top_k: keep the k most likely tokens (0 or -1: all).
      top_p: keep the smallest set of tokens whose probability reaches top_p (1.0: all).
      seed: per-request seed; a request's samples then do not depend on what it is batched with.
      stop: strings that end generation; the text is cut before the stop string.
      stop_token_ids: token ids that end generation (besides EOS).
      ignore_eos: keep going past EOS.
      logprobs: return the top-`logprobs` log-probabilities of each generated position (at most 20).
      prompt_logprobs: return, for each prompt position, the log-probability of the prompt token there and
        the top-`prompt_logprobs` ones (at most 20) as vLLM does: the first position has none (None), each later
        one a dict {token id: logprob} holding the prompt token and the top-k. Computed in the prefill steps.
      skip_special_tokens: drop special tokens from the text.
      logit_bias: {token id: bias in [-100, 100]} added to the logits before sampling (greedy included), as
        OpenAI's `logit_bias`; at most `MAX_LOGIT_BIAS` entries. Log-probabilities stay those of the model.
      n: completions to return for the prompt (vLLM's `n`); the engine runs each as its own sequence.
      best_of: candidates to generate (None: n); the n of highest cumulative log-probability are returned.
        Must be >= n. As in vLLM, the engine itself samples one sequence per request: the offline API and the
        server fan a request out into `best_of` sequences.
      presence_penalty: subtracted from the logit of each token the output holds already (OpenAI's, [-2, 2]).
      frequency_penalty: subtracted once per occurrence of the token in the output (OpenAI's, [-2, 2]).
      repetition_penalty: (vLLM / HF transformers) tokens of the prompt or the output have positive logits divided
        by it and negative ones multiplied (> 0; 1: off).
      min_p: drop tokens whose probability (after temperature) is below `min_p` times the most likely one's
        ([0, 1]; 0: off). Sampled rows only, as vLLM.
      min_tokens: EOS and `stop_token_ids` cannot be sampled, and stop strings are not looked for, before this
        many tokens are generated (<= max_tokens).
      bad_words: words that never appear in the output (vLLM's semantics: each is tokenised with and without a
        leading space; the last token of such a token sequence is banned where the output ends with the others).
        At most `MAX_BAN_TOKENS` tokens each; with min_tokens' stop ids at most `MAX_BANS` sequences.
      allowed_token_ids: only these tokens can be sampled (non-empty when given).
      include_stop_str_in_output: keep the stop string (or the text of the stop token) at the end of the text.
      structured_outputs: the output must follow a JSON schema, a regex, a choice of strings, an EBNF grammar or
        be a JSON object (`jhybrid.engine.structured_output.StructuredOutputsParams`). The request ends ("stop")
        when the grammar accepts a stop token (EOS or `stop_token_ids`). Log-probabilities stay the model's.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: Mapping[int, float] | None = None
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    bad_words: Sequence[str] = ()
    allowed_token_ids: Sequence[int] | None = None
    include_stop_str_in_output: bool = False
    structured_outputs: Any = None  # StructuredOutputsParams | None (imported lazily: it needs xgrammar)

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        # every integer below reaches an int32 array of the step; every float must be finite
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX:
            raise ValueError(f"max_tokens must be an integer in [1, {INT32_MAX}], got {self.max_tokens!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or not self.n <= self.best_of <= MAX_N):
            raise ValueError(f"best_of must be an integer in [n, {MAX_N}] (n={self.n}), got {self.best_of!r}")
        if not _is_real(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer below 2**31, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**32):
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not (_is_int(self.prompt_logprobs)
                                                     and 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not _is_int(t) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers in [0, 2**31), got {self.stop_token_ids!r}")
        if self.logit_bias is not None:
            bias = dict(self.logit_bias)
            if len(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are supported")
            for t, b in bias.items():
                if not _is_int(t) or not 0 <= t <= INT32_MAX:
                    raise ValueError(f"logit_bias keys must be token ids in [0, 2**31), got {t!r}")
                if not _is_real(b) or not -100.0 <= b <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {b!r} for token {t}")
            object.__setattr__(self, "logit_bias", {int(t): float(b) for t, b in bias.items()} or None)
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_real(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100] (1: off), got {self.repetition_penalty!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got "
                             f"{self.min_tokens!r}")
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be non-blank strings, got {self.bad_words!r}")
        if self.allowed_token_ids is not None:
            allowed = tuple(self.allowed_token_ids)
            if not allowed or any(not _is_int(t) or not 0 <= t <= INT32_MAX for t in allowed):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {allowed!r}")
            object.__setattr__(self, "allowed_token_ids", allowed)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}")
        if self.structured_outputs is not None:
            from jhybrid.engine.structured_output import StructuredOutputsParams

            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def stop_ids(self, eos_token_ids) -> tuple[int, ...]:
        """The token ids that end this request: `stop_token_ids` and, unless `ignore_eos`, the model's EOS ids."""
        return tuple(dict.fromkeys((*(() if self.ignore_eos else sorted(eos_token_ids)), *self.stop_token_ids)))


def bad_words_token_ids(tokenizer, bad_words: Sequence[str]) -> list[list[int]]:
    """The token sequences of `bad_words`, as vLLM makes them (`SamplingParams.update_from_tokenizer`): each word
    (left-stripped) tokenised without special tokens, and again after a leading space when that gives a
    different first token in as many tokens (the word inside text)."""
    out: list[list[int]] = []
    for word in bad_words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        out.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return [ids for ids in out if ids]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingArrays:
    """Per-row sampling parameters as arrays `[B]` (padding rows: greedy, no log-probabilities, flags 0; their
    slot is the null slot 0, whose table rows hold no bias)."""

    temperature: Float[Array, "B"]
    top_k: Int[Array, "B"]  # 0 = off
    top_p: Float[Array, "B"]
    seeds: Int[Array, "B"]  # uint32 seed of each request
    counters: Int[Array, "B"]  # which sample of the request this is (folds into the key)
    want_logprobs: Int[Array, "B"]  # 1: the row's top log-probabilities are read
    slot_ids: Int[Array, "B"]  # each row's state slot: its rows of the `SlotTables` and `TokenHistory`
    flags: Int[Array, "B"]  # FLAG_PENALTIES | FLAG_BANS | FLAG_ALLOWED | FLAG_MASKED | FLAG_BIAS: what the row reads
    min_p: Float[Array, "B"]  # 0 = off
    presence_penalty: Float[Array, "B"]
    frequency_penalty: Float[Array, "B"]
    repetition_penalty: Float[Array, "B"]  # 1 = off
    num_output: Int[Array, "B"]  # output tokens before this row's sample (bans hold while it is below `until`)
    recent: Int[Array, "B W1"]  # the last MAX_BAN_TOKENS - 1 output tokens, right-aligned (-2: none)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class SlotTables:
    """What a request asks for that does not fit in a row of metadata, one row per state slot (S), written when
    a sequence takes a slot (`jhybrid.engine.slot_tables`); slot 0 (the null slot of padding rows) holds no bias.

    `bans` rows: MAX_BANS entries of MAX_BAN_TOKENS + 1 ints: the banned token sequence right-aligned (-1
    before it: any token), its last token the one banned, then `until`: the ban holds while the row's output is
    shorter than that (INT32_MAX: bad words; min_tokens: the stop ids). An entry whose last token is -1 is empty.
    """

    bias_ids: Int[Array, "S NB"]  # logit bias: token ids (padding: token 0 with value 0)
    bias_values: Float[Array, "S NB"]
    bans: Int[Array, "S NW W"]  # W = MAX_BAN_TOKENS + 1
    allowed: Array  # [S, V] bool: the tokens a FLAG_ALLOWED row may sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenHistory:
    """Per state slot, the tokens fed so far (of rows with FLAG_PENALTIES; the step adds each token it feeds,
    `record_fed_tokens`): how often each token occurs in the output and whether it occurs in the prompt."""

    output_counts: Int[Array, "S V"]
    prompt_mask: Array  # [S, V] bool


def record_fed_tokens(history: TokenHistory, slots: Int[Array, "T"], token_ids: Int[Array, "T"],
                      is_output: Array, keep: Array) -> TokenHistory:
    """Adds the step's fed tokens (`[T]`: each token's slot, id, whether it is an output token, whether to
    record it at all) to `history`: a scatter of T entries into the donated tables."""
    num_slots = history.output_counts.shape[0]
    out_slot = jnp.where(keep & is_output, slots, num_slots)  # out of range: dropped
    prompt_slot = jnp.where(keep & ~is_output, slots, num_slots)
    return TokenHistory(output_counts=history.output_counts.at[out_slot, token_ids].add(1, mode="drop"),
                        prompt_mask=history.prompt_mask.at[prompt_slot, token_ids].set(True, mode="drop"))


class SamplerPlan(NamedTuple):
    """Which of the sampler's optional parts a step runs, decided on the host (`plan_for`) instead of by
    `lax.cond` on the device: each is what its cond's predicate would be (some row of the step needs it), so
    the outputs are those of the conds. The multi-step decode program (`jhybrid.engine.runner`) samples inside a
    loop of decode steps, where XLA would read every cond's predicate back to the host in every inner step."""

    allowed: bool = False
    bans: bool = False
    penalties: bool = False
    draw: bool = False  # some row samples (temperature > 0)
    filtered: bool = False  # some sampling row has top-k or top-p
    top: bool = False  # some row wants log-probabilities

    @property
    def name(self) -> str:
        """The parts it runs, joined by "+" ("greedy" for none)."""
        return "+".join(f for f, on in zip(self._fields, self) if on) or "greedy"


def plan_for(params: Sequence[SamplingParams], flags: Sequence[int]) -> SamplerPlan:
    """The `SamplerPlan` of a step whose rows sample with `params`, their sequences' table `flags`."""
    any_flag = 0
    for f in flags:
        any_flag |= f
    return SamplerPlan(allowed=bool(any_flag & FLAG_ALLOWED), bans=bool(any_flag & FLAG_BANS),
                       penalties=bool(any_flag & FLAG_PENALTIES), draw=any(not p.greedy for p in params),
                       filtered=any(p.filtered for p in params), top=any(p.logprobs is not None for p in params))


def _cond_with_rows(pred, true_fn, false_fn, s: SamplingArrays, operand):
    """`lax.cond(pred, true_fn, false_fn, s, operand)` with `s`'s arrays packed into one int32 vector on the way in
    and unpacked inside each branch. A cond's operands are buffers of their own, so each array it takes that is a
    slice of the step's packed metadata (most of `s`) is one more kernel before it (a copy); packed, they are one
    (benchmarks/RESULTS.md, "Session 38")."""
    leaves, treedef = jax.tree.flatten(s)
    shapes = [leaf.shape for leaf in leaves]
    dtypes = [leaf.dtype for leaf in leaves]
    packed = jnp.concatenate([jax.lax.bitcast_convert_type(leaf, jnp.int32).reshape(-1) for leaf in leaves])

    def unpack(v):
        out, at = [], 0
        for shape, dtype in zip(shapes, dtypes):
            n = math.prod(shape)
            out.append(jax.lax.bitcast_convert_type(v[at : at + n].reshape(shape), dtype))
            at += n
        return jax.tree.unflatten(treedef, out)

    return jax.lax.cond(pred, lambda v, o: true_fn(unpack(v), o), lambda v, o: false_fn(unpack(v), o), packed,
                        operand)


def sample(
    logits: Float[Array, "B V"], s: SamplingArrays, tables: SlotTables, history: TokenHistory,
    token_mask: Int[Array, "B W"] | None = None, plan: SamplerPlan | None = None,
) -> tuple[Int[Array, "B"], Float[Array, "B"], Float[Array, "B L"], Int[Array, "B L"]]:
    """Samples one token per row, every setting a runtime array.

    Returns (tokens, logprob of each token, top-`MAX_LOGPROBS` logprobs and their ids). Logprobs are of the
    model's distribution (before bias, penalties, masks, temperature and filtering), as vLLM reports them by
    default; the top ones are computed only when some row wants them (zeros otherwise). Drawing, top-k / top-p
    filtering, the allowed-token mask, bans and penalties run only when some row needs them (`lax.cond`; the
    parts that modify the logits, the logit bias among them, under one more cond, whose result is the tokens), so an
    all-greedy step pays for an argmax and each row's normaliser alone. `token_mask` (`[B, ceil(V/32)]` int32, bit
    t % 32 of word t // 32 set: token t allowed) is the structured-output grammar bitmask, read by rows with
    FLAG_MASKED.
    """
    raw, num_rows = logits, logits.shape[0]  # raw: the model's logits in its dtype (bf16), cast where read

    def fp32(y):
        return y.astype(jnp.float32)

    # The sampled tokens' logprobs need only each row's normaliser, not a `[B, V]` log_softmax, which a step would
    # write and read again whether or not a row wants logprobs (benchmarks/RESULTS.md, "Session 38"). The same
    # operations as log_softmax's (the max of the cast values is the cast of the max).
    row_max = fp32(jnp.max(raw, axis=-1))
    log_norm = jnp.log(jnp.sum(jnp.exp(fp32(raw) - row_max[:, None]), axis=-1))

    def uses(s, flag):
        return (s.flags & flag) != 0

    def add_bias(s, y):
        rows = jnp.arange(num_rows)[:, None]
        return y.at[rows, tables.bias_ids[s.slot_ids]].add(tables.bias_values[s.slot_ids])

    def restrict(s, y):
        return jnp.where(tables.allowed[s.slot_ids] | ~uses(s, FLAG_ALLOWED)[:, None], y, -jnp.inf)

    def ban(s, y):
        return _apply_bans(y, tables.bans[s.slot_ids], s.recent,
                           jnp.where(uses(s, FLAG_BANS), s.num_output, INT32_MAX))

    def penalise(s, y):
        return apply_penalties(y, history.output_counts[s.slot_ids], history.prompt_mask[s.slot_ids],
                               s.presence_penalty, s.frequency_penalty, s.repetition_penalty)

    def constrain(s, y):
        return apply_token_bitmask(y, token_mask, uses(s, FLAG_MASKED))

    def when(part, needed, f, s, y):
        """`f(s, y)` where some row needs it: decided by `plan`'s `part` when there is a plan (no part: always),
        else by `lax.cond` on `needed()` (`s` carried through it packed: `_cond_with_rows`)."""
        if plan is not None:
            return f(s, y) if part is None or getattr(plan, part) else y
        return _cond_with_rows(needed(), f, lambda s, y: y, s, y)

    def modify(s, x):
        """The bias, mask, allowed tokens, bans and penalties, each where some row needs it."""
        x = add_bias(s, x)
        if token_mask is not None:
            x = when(None, lambda: jnp.any(uses(s, FLAG_MASKED)), constrain, s, x)
        x = when("allowed", lambda: jnp.any(uses(s, FLAG_ALLOWED)), restrict, s, x)
        x = when("bans", lambda: jnp.any(uses(s, FLAG_BANS)), ban, s, x)
        return when("penalties", lambda: jnp.any(uses(s, FLAG_PENALTIES)), penalise, s, x)

    def draw(s, x, greedy_tokens):
        sampled = s.temperature > 0
        temp = jnp.where(sampled, s.temperature, 1.0)[:, None]
        scaled = x / temp
        # min_p: p < min_p * p_max  <=>  logit < max logit + log(min_p) (log 0 = -inf: nothing dropped)
        floor = jnp.max(scaled, axis=-1) + jnp.log(s.min_p)
        scaled = jnp.where(scaled < floor[:, None], -jnp.inf, scaled)
        filtered = sampled & ((s.top_k > 0) | (s.top_p < 1.0))
        # rows that draw nothing ask for no filter (their settings would only keep the candidates from deciding)
        top_k, top_p = jnp.where(filtered, s.top_k, 0), jnp.where(filtered, s.top_p, 1.0)
        scaled = when("filtered", lambda: jnp.any(filtered),
                      lambda _, y: _filter_top_k_top_p(y, top_k, top_p), s, scaled)
        keys = jax.vmap(lambda seed, n: jax.random.fold_in(jax.random.key(seed), n))(
            s.seeds.astype(jnp.uint32), s.counters
        )
        drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        return jnp.where(sampled, drawn, greedy_tokens)

    def choose(s, y):
        """Each row's token from its (modified) logits `y`: the argmax (of the model's dtype when unmodified: the
        cast changes no order), or a draw where the row samples (in fp32)."""
        greedy_tokens = jnp.argmax(y, axis=-1).astype(jnp.int32)
        if plan is None:
            return _cond_with_rows(jnp.any(s.temperature > 0), lambda s, yg: draw(s, fp32(yg[0]), yg[1]),
                                   lambda s, yg: yg[1], s, (y, greedy_tokens))
        return draw(s, fp32(y), greedy_tokens) if plan.draw else greedy_tokens

    if plan is None:
        # One cond around the parts that modify the logits, whose result is the tokens: a `lax.cond` whose skipped
        # branch passes the `[B, V]` logits through unchanged copies them whole (XLA's copy insertion), which the
        # four parts' conds did in every step that needed none of them: four copies of the fp32 logits, 1.2 GB at
        # 256 rows of a 151,936-token vocabulary (benchmarks/RESULTS.md, "Session 37"). The bias is one of the
        # parts: a step that adds none writes the fp32 logits once (XLA's cast, hoisted out of the conds), where the
        # bias's scatter into them made XLA write a second copy for the normaliser's reads (session 38).
        parts = FLAG_BIAS | FLAG_ALLOWED | FLAG_BANS | FLAG_PENALTIES | (FLAG_MASKED if token_mask is not None else 0)
        tokens = _cond_with_rows(jnp.any(uses(s, parts)), lambda s, r: choose(s, modify(s, fp32(r))), choose, s, raw)
    else:  # (the multi-step programs, at few rows, add the bias whatever the rows)
        tokens = choose(s, modify(s, fp32(raw)))
    token_logp = (fp32(jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]) - row_max) - log_norm

    def top(raw):
        lp, ids = top_k_exact(jax.nn.log_softmax(fp32(raw), axis=-1), MAX_LOGPROBS)
        return lp, ids.astype(jnp.int32)

    def no_top(x):
        return jnp.zeros((num_rows, MAX_LOGPROBS), jnp.float32), jnp.zeros((num_rows, MAX_LOGPROBS), jnp.int32)

    if plan is None:
        top_lp, top_ids = jax.lax.cond(jnp.any(s.want_logprobs > 0), top, no_top, raw)
    else:
        top_lp, top_ids = (top if plan.top else no_top)(raw)
    return tokens, token_logp, top_lp, top_ids


GPU_TOPK_MAX_K = 16  # the largest k of XLA's GPU TopK kernel; a larger k is lowered to a sort of the whole row


TOP_K_BLOCK = 64  # `top_k_exact` first picks each row's k best blocks of this many values by their maxima (0: never;
# the fastest width at a batch on the H200: benchmarks/RESULTS.md, "Session 19")


def top_k_exact(x: Float[Array, "B V"], k: int,
                block: int | None = None) -> tuple[Float[Array, "B k"], Int[Array, "B k"]]:
    """`lax.top_k(x, k)` (the same values and indices, ties in index order; on the whole-row path, indices past a
    row's finite values may repeat).

    With `block` (default `TOP_K_BLOCK`) the row is cut into blocks of `block` values; the k blocks of largest
    maxima (ties: the lower block) hold the row's top k, so only they are searched: a top k of the blocks' maxima
    (`[B, V / block]`), a gather of those k blocks in index order, and a top k of the `k * block` values. Exact,
    ties included: every value above the k-th block maximum m is in a chosen block (fewer than k blocks have a
    maximum above m); the values equal to m that the top k needs are at most as many as the chosen blocks of
    maximum m, each of which holds one and comes before every block of maximum m that was not chosen.

    Otherwise the top k is taken in passes of at most `GPU_TOPK_MAX_K` (the largest k of XLA's GPU TopK kernel;
    above it `lax.top_k` sorts the whole row), each pass the next best with the ones found so far set to -inf.
    XLA's GPU TopK kernel takes about as long per row whatever the row's length, so the whole-row passes cost
    several times the blocks' work at a decode step's shape (benchmarks/RESULTS.md, "Session 19")."""
    block = TOP_K_BLOCK if block is None else block
    num_rows, width = x.shape
    num_blocks = -(-width // block) if block else 0
    if num_blocks <= k or k * block >= width:
        return _top_k_passes(x, k)
    padded = jnp.pad(x, ((0, 0), (0, num_blocks * block - width)), constant_values=-jnp.inf)  # after every real value
    blocks = padded.reshape(num_rows, num_blocks, block)
    _, chosen = jax.lax.top_k(jnp.max(blocks, axis=-1), k)
    chosen = jnp.sort(chosen, axis=-1)  # index order, so equal values stay in index order below
    values, at = jax.lax.top_k(jnp.take_along_axis(blocks, chosen[:, :, None], axis=1).reshape(num_rows, k * block), k)
    return values, jnp.take_along_axis(chosen, at // block, axis=-1) * block + at % block


def _top_k_passes(x: Float[Array, "B V"], k: int) -> tuple[Float[Array, "B k"], Int[Array, "B k"]]:
    """`lax.top_k(x, k)` as top-k passes of at most `GPU_TOPK_MAX_K` (see `top_k_exact`)."""
    if k <= GPU_TOPK_MAX_K:
        return jax.lax.top_k(x, k)
    values, ids = jax.lax.top_k(x, GPU_TOPK_MAX_K)
    rest = x.at[jnp.arange(x.shape[0])[:, None], ids].set(-jnp.inf)
    more_values, more_ids = _top_k_passes(rest, k - GPU_TOPK_MAX_K)
    return jnp.concatenate([values, more_values], axis=-1), jnp.concatenate([ids, more_ids], axis=-1)


def apply_token_bitmask(logits: Float[Array, "B V"], token_mask: Int[Array, "B W"], rows: Array) -> Array:
    """Sets to -inf the tokens whose bit is clear in `token_mask` (`[B, W]` int32, W = ceil(V / 32): token t is
    bit t % 32 of word t // 32), in the rows where `rows [B]` (bool) holds."""
    num_rows, vocab = logits.shape
    bits = (token_mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    allowed = bits.reshape(num_rows, -1)[:, :vocab] != 0  # [B, V]
    return jnp.where(allowed | ~rows[:, None], logits, -jnp.inf)


def apply_penalties(logits: Float[Array, "B V"], output_counts: Int[Array, "B V"], prompt_mask: Array,
                    presence: Float[Array, "B"], frequency: Float[Array, "B"], repetition: Float[Array, "B"]) -> Array:
    """vLLM's penalties (`apply_penalties`): tokens of the prompt or the output have positive logits divided by
    the repetition penalty and the others multiplied; then the frequency penalty times each token's count in the
    output and the presence penalty for each token in it are subtracted (OpenAI's definition)."""
    in_output = output_counts > 0
    rep = jnp.where(prompt_mask | in_output, repetition[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    return logits - frequency[:, None] * output_counts - presence[:, None] * in_output


def _apply_bans(logits: Float[Array, "B V"], bans: Int[Array, "B NW W"], recent: Int[Array, "B W1"],
                num_output: Int[Array, "B"]) -> Array:
    """Sets to -inf each row's banned tokens: the last token of every entry whose earlier tokens are the end of
    the output (`recent`) and whose `until` the output has not reached (see `SlotTables`)."""
    width = bans.shape[-1] - 1
    prefix, last, until = bans[..., : width - 1], bans[..., width - 1], bans[..., width]  # [B, NW, W-1], [B, NW]
    matches = jnp.all((prefix == -1) | (prefix == recent[:, None, :]), axis=-1)
    banned = matches & (last >= 0) & (num_output[:, None] < until)  # [B, NW]
    vocab = logits.shape[-1]
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, jnp.where(banned, last, vocab)].set(-jnp.inf, mode="drop")


TOP_K_TOP_P_IMPL = "xla"  # how `_filter_top_k_top_p` finds its thresholds on a GPU: "xla" (radix passes of XLA row
# reductions) or "pallas" (one kernel for both: pallas_kernels/sampling; benchmarks/sampler_kernels.py); read at trace time


FILTER_CANDIDATES = 64  # `_filter_top_k_top_p` first looks for both thresholds among each row's this many
# largest logits (0: never; see `_thresholds_from_candidates`; faster than the radix passes alone at a batch on the
# H200: benchmarks/RESULTS.md, "Session 19")
FILTER_CANDIDATES_ON_CPU = False  # its second branch makes every step program slower for XLA:CPU to compile (the
# fast test tier took a fifth longer), and a CPU engine's sampler is not its bottleneck; tests/test_engine.py turns
# it on to check the engine's path


def _filter_top_k_top_p(logits: Float[Array, "B V"], top_k: Int[Array, "B"], top_p: Float[Array, "B"],
                        rolled: bool | None = None, candidates: int | None = None) -> Array:
    """Masks (to -inf) tokens outside each row's top-k and top-p sets, as vLLM defines them: the top-k set is
    every token at or above the k-th largest logit (ties kept); top-p then keeps, over the top-k set's softmax,
    the tokens whose more likely tokens (in descending order) hold less than `top_p` of the mass (so at least
    the most likely one), i.e. every token at or above the largest logit t with mass(logits >= t) >= top_p.

    No sort of the vocabulary: both thresholds are found by `_radix_threshold` (a few masked reductions over the
    row); a sort of [64, 151936] was most of what top-k / top-p cost a decode step (benchmarks/RESULTS.md).
    `rolled`: the form of the radix passes (`_radix_threshold`; None: the backend's).

    With `TOP_K_TOP_P_IMPL == "pallas"` on a GPU both thresholds come from one Pallas kernel instead
    (`pallas_kernels.sampling`: the same keys and thresholds; top-p equal up to float32 rounding of the sums).

    `candidates` (None: `FILTER_CANDIDATES`, on the CPU only with `FILTER_CANDIDATES_ON_CPU`): when every row's
    thresholds can be read off its `candidates` largest logits (`_thresholds_from_candidates`), they are, and the
    radix passes over the whole vocabulary are skipped (`lax.cond`); the same tokens are kept, top-p up to float32
    rounding of the sums."""
    vocab = logits.shape[-1]
    if candidates is None:
        candidates = FILTER_CANDIDATES if jax.default_backend() != "cpu" or FILTER_CANDIDATES_ON_CPU else 0
    candidates = min(candidates, vocab)
    if candidates:
        ok, threshold = _thresholds_from_candidates(logits, top_k, top_p, candidates)
        return jax.lax.cond(
            jnp.all(ok),
            lambda y: jnp.where(_order_keys(y) >= _order_keys(threshold)[:, None], y, -jnp.inf),
            lambda y: _filter_top_k_top_p(y, top_k, top_p, rolled, candidates=0),
            logits,
        )
    keys = _order_keys(logits)
    if TOP_K_TOP_P_IMPL == "pallas" and jax.default_backend() == "gpu":
        from pallas_kernels.sampling import top_k_top_p_thresholds

        kth, pth = top_k_top_p_thresholds(logits, top_k, top_p, impl="pallas")
        return jnp.where(keys >= jnp.maximum(kth, pth)[:, None], logits, -jnp.inf)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab).astype(jnp.float32)
    kth = _radix_threshold(keys, jnp.ones_like(logits), k, rolled)
    in_top_k = keys >= kth[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, logits, -jnp.inf), axis=-1)  # renormalised over the top-k set
    # top_p == 1 keeps everything (an unreachable target leaves the threshold at the bottom)
    pth = _radix_threshold(keys, probs, jnp.where(top_p < 1.0, top_p, 2.0), rolled)
    return jnp.where(in_top_k & (keys >= pth[:, None]), logits, -jnp.inf)


def _thresholds_from_candidates(logits: Float[Array, "B V"], top_k: Int[Array, "B"], top_p: Float[Array, "B"],
                                candidates: int) -> tuple[Array, Float[Array, "B"]]:
    """Per row, whether its top-k / top-p thresholds lie among its `candidates` largest logits, and if so the
    threshold (keep the logits >= it; -inf keeps all) that `_filter_top_k_top_p` would find.

    With the candidates `v` in descending order (`top_k_exact`; only their values are read), a threshold is
    `v[j]` for some j; it is the row's own when every logit >= `v[j]` is a candidate, that is `v[j] > v[-1]` (or
    the whole row is candidates). Top-k (k <= the candidates) is `v[k - 1]`; top-k of the whole vocabulary keeps all.
    Top-p is `v[j]` for the first j whose cumulative mass, over the top-k set's softmax, reaches p: the set's
    normaliser is the candidates' own when the top-k threshold is, and the whole row's (one logsumexp) when top-k
    keeps all. A row with top-k between the candidates and the vocabulary, or a nucleus past the candidates, is
    not resolved (its radix passes run)."""
    vocab = logits.shape[-1]
    values, _ = top_k_exact(logits, candidates)  # [B, C], descending
    last = values[:, -1]
    whole_row = candidates == vocab
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(values, jnp.clip(k - 1, 0, candidates - 1)[:, None], axis=-1)[:, 0]
    keeps_all = k == vocab
    kth = jnp.where(keeps_all, -jnp.inf, kth)
    # a k past the candidates reads the last one (clipped), which fails `kth > last`; kth == -inf: every finite
    # logit is a candidate (fewer of them than k), and the -inf ones weigh nothing
    k_ok = keeps_all | whole_row | (kth > last) | (kth == -jnp.inf)
    in_set = values >= kth[:, None]
    norm = jnp.where(keeps_all, jax.nn.logsumexp(logits, axis=-1),
                     jax.nn.logsumexp(jnp.where(in_set, values, -jnp.inf), axis=-1))
    probs = jnp.where(in_set, jnp.exp(values - norm[:, None]), 0.0)
    reached = jnp.cumsum(probs, axis=-1) >= top_p[:, None]
    j = jnp.argmax(reached, axis=-1)  # the first that reaches p
    pth = jnp.take_along_axis(values, j[:, None], axis=-1)[:, 0]
    wants_p = top_p < 1.0
    p_ok = ~wants_p | jnp.any(reached, axis=-1) & (whole_row | (pth > last))
    threshold = jnp.where(wants_p, jnp.maximum(kth, pth), kth)
    return k_ok & p_ok, threshold


RADIX_BITS = 2  # key bits decided per pass of `_radix_threshold` (2**RADIX_BITS - 1 candidate sums per pass; 2 was
# the fastest of 1, 2 and 4 on the H200: benchmarks/sampler_kernels.py)


def _order_keys(x: Float[Array, "B V"]) -> Array:
    """uint32 keys whose unsigned order is the float32 order of `x` (-inf lowest; no NaN)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def _masked_sums(keys: Array, weights: Float[Array, "B V"], cand: Array) -> Float[Array, "B C"]:
    """sum(weights[keys >= cand[:, j]]) per row and candidate j."""
    return jnp.stack([jnp.sum(jnp.where(keys >= cand[:, j : j + 1], weights, 0.0), axis=-1)
                      for j in range(cand.shape[1])], axis=-1)


def _radix_threshold(keys: Array, weights: Float[Array, "B V"], target: Float[Array, "B"],
                     rolled: bool | None = None) -> Array:
    """Per row, the largest uint32 t with sum(weights[keys >= t]) >= target (0 where no t reaches it), for
    non-negative weights: decided RADIX_BITS bits at a time from the top, each pass summing the row's weights at
    or above every candidate value of those bits (a radix select; exact for counts, and for masses up to the
    float32 rounding of their sums).

    The passes are unrolled on a GPU (the measured form: XLA:GPU runs a while loop outside its CUDA graphs) and
    a `fori_loop` on the CPU, where the 16 unrolled passes were most of the compile time of every step program
    (about 1 s of XLA:CPU each); `rolled` forces one form (the tests check that both agree)."""
    width = 1 << RADIX_BITS
    num_passes = 32 // RADIX_BITS
    digits = jnp.arange(1, width, dtype=jnp.uint32)  # candidate values of the next bits

    def one_pass(i, ans):
        shift = jnp.uint32(32 - RADIX_BITS) - jnp.uint32(RADIX_BITS) * jnp.asarray(i, jnp.uint32)
        cand = ans[:, None] | (digits[None, :] << shift)  # [B, width - 1], increasing
        mass = _masked_sums(keys, weights, cand)
        reached = mass >= target[:, None]  # true for a prefix of the candidates (mass decreases along them)
        best = jnp.sum(reached, axis=-1).astype(jnp.uint32)  # how many: the digit itself
        return ans | (best << shift)

    ans = jnp.zeros(keys.shape[:1], jnp.uint32)
    if rolled if rolled is not None else jax.default_backend() == "cpu":
        return jax.lax.fori_loop(0, num_passes, one_pass, ans)
    for i in range(num_passes):
        ans = one_pass(i, ans)
    return ans


PROMPT_LOGPROB_CHUNK = 256  # positions whose logits exist at once when computing prompt log-probabilities


def prompt_logprobs(
    head, hidden: Float[Array, "T D"], targets: Int[Array, "T"], want_top: Array
) -> tuple[Float[Array, "T"], Float[Array, "T L"], Int[Array, "T L"]]:
    """Log-probabilities of each packed position's next prompt token, from the hidden states the step has.

    `head` maps hidden states `[C, D]` to fp32 logits `[C, V]`; `targets` holds the token whose logprob each
    position predicts (-1: none wanted, its logprob is that of token 0). The logits are made `PROMPT_LOGPROB_CHUNK`
    positions at a time (`lax.map`), so at most `[C, V]` of them exist at once. Returns (logprob of each target,
    top-`MAX_LOGPROBS` logprobs and ids of each position); the top ones only when the scalar `want_top` (zeros
    otherwise).
    """
    num_tokens, dim = hidden.shape
    chunk = min(num_tokens, PROMPT_LOGPROB_CHUNK)
    if num_tokens % chunk:
        raise ValueError(f"{num_tokens=} must be a multiple of {chunk=} (token buckets are powers of two)")

    def one(args):
        x, t = args  # [C, D], [C]
        logp = jax.nn.log_softmax(head(x).astype(jnp.float32), axis=-1)  # [C, V]
        lp = jnp.take_along_axis(logp, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0]

        def top(y):
            top_lp, ids = top_k_exact(y, MAX_LOGPROBS)
            return top_lp, ids.astype(jnp.int32)

        def no_top(y):
            return jnp.zeros((chunk, MAX_LOGPROBS), jnp.float32), jnp.zeros((chunk, MAX_LOGPROBS), jnp.int32)

        return (lp, *jax.lax.cond(want_top, top, no_top, logp))

    lp, top_lp, top_ids = jax.lax.map(one, (hidden.reshape(-1, chunk, dim), targets.reshape(-1, chunk)))
    return lp.reshape(num_tokens), top_lp.reshape(num_tokens, MAX_LOGPROBS), top_ids.reshape(num_tokens, MAX_LOGPROBS)
