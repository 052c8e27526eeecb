"""The simple generation path: one sequence at a time, prefill (optionally chunked) then decode.

This is the foundation's path: it drives the model through the state pytree exactly as the engine will
(block tables, state slots zeroed on assignment, bucketed shapes), without continuous batching.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.cache import BlockAllocator, CacheConfig, SlotAllocator, init_state, zero_slots
from jhybrid.config import ModelConfig
from jhybrid.models import RowSpec, forward, make_batch

_step = jax.jit(forward, static_argnames=("cfg", "decode", "all_logits"), donate_argnames=("state",))


@dataclasses.dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" | "length"


@dataclasses.dataclass
class LoadedModel:
    cfg: ModelConfig
    params: Any
    tokenizer: Any = None
    eos_token_ids: tuple[int, ...] = ()


def _bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def load(model: str | os.PathLike | LoadedModel, dtype: str | None = None) -> LoadedModel:
    """A model directory (HF or converted) or an already loaded model."""
    if isinstance(model, LoadedModel):
        return model
    from jhybrid.checkpoint import load_model
    from jhybrid.tokenizer import load_tokenizer

    cfg, params = load_model(model, dtype=dtype)
    tokenizer = load_tokenizer(model)
    eos = set(cfg.eos_token_ids)
    gen_path = os.path.join(model, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
        eos.update(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
    return LoadedModel(cfg=cfg, params=params, tokenizer=tokenizer, eos_token_ids=tuple(sorted(eos)))


class SequenceRunner:
    """Runs one sequence at a time through the paged KV cache and one state slot."""

    def __init__(self, cfg: ModelConfig, params: Any, *, max_len: int, block_size: int = 16, kv_dtype=None):
        self.cfg, self.params = cfg, params
        self.block_size = block_size
        self.max_blocks = _bucket(-(-max_len // block_size), minimum=1)
        kv_dtype = kv_dtype or jax.tree_util.tree_leaves(params)[0].dtype
        self.cache = CacheConfig(
            num_blocks=self.max_blocks + 1, block_size=block_size, num_slots=2, kv_dtype=jnp.dtype(kv_dtype).name
        )
        self.state = init_state(cfg, self.cache)
        self.blocks = BlockAllocator(self.cache.num_blocks, block_size)
        self.slots = SlotAllocator(self.cache.num_slots)

    def start(self) -> tuple[list[int], int]:
        """Takes the blocks and a (zeroed) slot for a new sequence."""
        table = self.blocks.allocate(self.max_blocks)
        (slot,) = self.slots.allocate(1)
        self.state = zero_slots(self.state, jnp.asarray([slot], jnp.int32))
        return table, slot

    def finish(self, table: list[int], slot: int) -> None:
        self.blocks.free(table)
        self.slots.free([slot])

    def step(self, token_ids: Sequence[int], start: int, table: list[int], slot: int, *, all_logits=False):
        """Feeds `token_ids` at positions `start..`; returns logits of the last (or every) token."""
        n = len(token_ids)
        if start + n > self.max_blocks * self.block_size:
            raise ValueError(f"sequence of {start + n} tokens exceeds this runner's {self.max_blocks * self.block_size}")
        decode = n == 1 and not all_logits
        batch = make_batch(
            [RowSpec(list(token_ids), start, table, slot)],
            block_size=self.block_size,
            max_blocks_per_seq=self.max_blocks,
            num_tokens=1 if decode else _bucket(n),
            num_rows=1,
        )
        batch = jax.tree.map(jnp.asarray, batch)
        logits, self.state = _step(self.cfg, self.params, self.state, batch, decode=decode, all_logits=all_logits)
        return logits[:n] if all_logits else logits[0]


def _sample(logits: jax.Array, temperature: float, key: jax.Array) -> int:
    if temperature <= 0.0:
        return int(jnp.argmax(logits))
    return int(jax.random.categorical(key, logits / temperature))


def generate(
    model: str | os.PathLike | LoadedModel,
    prompts: Sequence[str | Sequence[int]],
    *,
    max_tokens: int = 16,
    temperature: float = 0.0,
    dtype: str | None = None,
    seed: int = 0,
    prefill_chunk_size: int | None = None,
    ignore_eos: bool = False,
) -> list[GenerationOutput]:
    """Generates a continuation of each prompt (a string, or a list of token ids).

    Greedy when `temperature == 0`. Stops at `max_tokens` or at an EOS id of the checkpoint
    (config / generation_config.json) unless `ignore_eos`. `prefill_chunk_size` splits the prompt into
    chunks that continue from the cached state (chunked prefill).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens=}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature=}")
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]  # one prompt given bare
    m = load(model, dtype)
    encoded = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if m.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer files: pass prompts as lists of token ids")
            ids = m.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        if min(ids) < 0 or max(ids) >= m.cfg.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {m.cfg.vocab_size}), got {min(ids)}..{max(ids)}")
        if len(ids) + max_tokens > m.cfg.max_position_embeddings:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                f"({m.cfg.max_position_embeddings})"
            )
        encoded.append(ids)
    runner = SequenceRunner(m.cfg, m.params, max_len=max(len(ids) for ids in encoded) + max_tokens)
    key = jax.random.key(seed)
    outputs = []
    for ids in encoded:
        table, slot = runner.start()
        try:
            chunk = prefill_chunk_size or len(ids)
            for start in range(0, len(ids), chunk):
                logits = runner.step(ids[start : start + chunk], start, table, slot)
            generated: list[int] = []
            finish = "length"
            while True:
                key, sub = jax.random.split(key)
                token = _sample(logits, temperature, sub)
                generated.append(token)
                if not ignore_eos and token in m.eos_token_ids:
                    finish = "stop"
                    break
                if len(generated) >= max_tokens:
                    break
                logits = runner.step([token], len(ids) + len(generated) - 1, table, slot)
        finally:
            runner.finish(table, slot)
        text = m.tokenizer.decode(generated) if m.tokenizer is not None else None
        outputs.append(GenerationOutput(list(ids), generated, text, finish))
    return outputs
