"""Sampling parameters (validated on the host) and the sampler that runs inside the jitted step."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

MAX_LOGPROBS = 20


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
      skip_special_tokens: drop special tokens from the text.
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
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**32):
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingArrays:
    """Per-row sampling parameters as arrays `[B]` (padding rows: greedy)."""

    temperature: Float[Array, "B"]
    top_k: Int[Array, "B"]  # 0 = off
    top_p: Float[Array, "B"]
    seeds: Int[Array, "B"]  # uint32 seed of each request
    counters: Int[Array, "B"]  # which sample of the request this is (folds into the key)


def sample(
    logits: Float[Array, "B V"],
    s: SamplingArrays,
    *,
    all_greedy: bool,
    filtered: bool,
    num_logprobs: int,
) -> tuple[Int[Array, "B"], Float[Array, "B"], Float[Array, "B L"] | None, Int[Array, "B L"] | None]:
    """Samples one token per row. Static flags skip work no row needs.

    Returns (tokens, logprob of each token, top-`num_logprobs` logprobs and their ids or None). Logprobs
    are of the model's distribution (before temperature and filtering), as vLLM reports them.
    """
    logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if all_greedy:
        tokens = greedy_tokens
    else:
        temp = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
        scaled = logits / temp
        if filtered:
            scaled = _filter_top_k_top_p(scaled, s.top_k, s.top_p)
        keys = jax.vmap(lambda seed, n: jax.random.fold_in(jax.random.key(seed), n))(
            s.seeds.astype(jnp.uint32), s.counters
        )
        drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        tokens = jnp.where(s.temperature > 0, drawn, greedy_tokens)
    token_logp = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    if num_logprobs:
        top_lp, top_ids = jax.lax.top_k(logp, num_logprobs)
        return tokens, token_logp, top_lp, top_ids.astype(jnp.int32)
    return tokens, token_logp, None, None


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
