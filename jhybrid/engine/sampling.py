"""Sampling parameters (validated on the host) and the sampler that runs inside the jitted step.

Every setting is a runtime array of the step, so one compiled program serves any mix of greedy, sampled,
filtered (top-k / top-p), biased and log-probability requests; work that no row of a step needs (drawing,
sorting for top-k / top-p, the top log-probabilities) is skipped by `lax.cond` on the device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries of `logit_bias` per request (the step holds this many per state slot)
INT32_MAX = 2**31 - 1
MAX_N = 128  # completions (n) and candidates (best_of) per request, OpenAI's limit on `n`


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingArrays:
    """Per-row sampling parameters as arrays `[B]` (padding rows: greedy, no log-probabilities, no bias)."""

    temperature: Float[Array, "B"]
    top_k: Int[Array, "B"]  # 0 = off
    top_p: Float[Array, "B"]
    seeds: Int[Array, "B"]  # uint32 seed of each request
    counters: Int[Array, "B"]  # which sample of the request this is (folds into the key)
    want_logprobs: Int[Array, "B"]  # 1: the row's top log-probabilities are read
    bias_ids: Int[Array, "B NB"]  # logit bias of each row: token ids (padding: token 0 with value 0)
    bias_values: Float[Array, "B NB"]


def sample(
    logits: Float[Array, "B V"], s: SamplingArrays
) -> tuple[Int[Array, "B"], Float[Array, "B"], Float[Array, "B L"], Int[Array, "B L"]]:
    """Samples one token per row, every setting a runtime array.

    Returns (tokens, logprob of each token, top-`MAX_LOGPROBS` logprobs and their ids). Logprobs are of the
    model's distribution (before bias, temperature and filtering), as vLLM reports them by default; the top
    ones are computed only when some row wants them (zeros otherwise). Drawing and top-k / top-p filtering
    run only when some row needs them (`lax.cond`), so an all-greedy step pays for an argmax alone.
    """
    logits = logits.astype(jnp.float32)
    num_rows = logits.shape[0]
    logp = jax.nn.log_softmax(logits, axis=-1)
    biased = logits.at[jnp.arange(num_rows)[:, None], s.bias_ids].add(s.bias_values)
    greedy_tokens = jnp.argmax(biased, axis=-1).astype(jnp.int32)
    sampled = s.temperature > 0

    def draw(x):
        temp = jnp.where(sampled, s.temperature, 1.0)[:, None]
        scaled = x / temp
        filtered = sampled & ((s.top_k > 0) | (s.top_p < 1.0))
        scaled = jax.lax.cond(jnp.any(filtered), lambda y: _filter_top_k_top_p(y, s.top_k, s.top_p),
                              lambda y: y, scaled)
        keys = jax.vmap(lambda seed, n: jax.random.fold_in(jax.random.key(seed), n))(
            s.seeds.astype(jnp.uint32), s.counters
        )
        drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        return jnp.where(sampled, drawn, greedy_tokens)

    tokens = jax.lax.cond(jnp.any(sampled), draw, lambda x: greedy_tokens, biased)
    token_logp = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]

    def top(x):
        lp, ids = jax.lax.top_k(x, MAX_LOGPROBS)
        return lp, ids.astype(jnp.int32)

    def no_top(x):
        return jnp.zeros((num_rows, MAX_LOGPROBS), jnp.float32), jnp.zeros((num_rows, MAX_LOGPROBS), jnp.int32)

    top_lp, top_ids = jax.lax.cond(jnp.any(s.want_logprobs > 0), top, no_top, logp)
    return tokens, token_logp, top_lp, top_ids


def _filter_top_k_top_p(logits: Float[Array, "B V"], top_k: Int[Array, "B"], top_p: Float[Array, "B"]) -> Array:
    """Masks (to -inf) tokens outside each row's top-k and top-p sets."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)  # [B, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # [B, 1]
    in_top_k = jnp.arange(vocab)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)  # top-p renormalised over top-k
    # keep a sorted token while the mass before it is < top_p (the first token is always kept)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < top_p[:, None]
    num_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    pth = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth, pth)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


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
            top_lp, ids = jax.lax.top_k(y, MAX_LOGPROBS)
            return top_lp, ids.astype(jnp.int32)

        def no_top(y):
            return jnp.zeros((chunk, MAX_LOGPROBS), jnp.float32), jnp.zeros((chunk, MAX_LOGPROBS), jnp.int32)

        return (lp, *jax.lax.cond(want_top, top, no_top, logp))

    lp, top_lp, top_ids = jax.lax.map(one, (hidden.reshape(-1, chunk, dim), targets.reshape(-1, chunk)))
    return lp.reshape(num_tokens), top_lp.reshape(num_tokens, MAX_LOGPROBS), top_ids.reshape(num_tokens, MAX_LOGPROBS)
