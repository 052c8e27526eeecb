"""Model loading, `jhybrid.generate` (a thin wrapper over `LLM`), and `SequenceRunner`.

`SequenceRunner` drives one sequence through the state pytree step by step (block tables, a slot zeroed
on assignment, bucketed shapes) and can return every token's logits: the tool parity tests use.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jhybrid.cache import BlockAllocator, CacheConfig, SlotAllocator, init_state, zero_slots
from jhybrid.config import ModelConfig
from jhybrid.models import RowSpec, forward, make_batch
from jhybrid.models.params import pack_params

_step = jax.jit(
    forward, static_argnames=("cfg", "decode", "all_logits", "kernel_impl", "interpret"), donate_argnames=("state",)
)


@dataclasses.dataclass
class LoadedModel:
    """A config with its parameters (packed for the model on construction), tokenizer and EOS ids."""

    cfg: ModelConfig
    params: Any
    tokenizer: Any = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        self.params = pack_params(self.params)


def _bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def load(model: str | os.PathLike | LoadedModel, dtype: str | None = None, *, host: bool = False) -> LoadedModel:
    """A model directory (HF or converted) or an already loaded model. `host`: read the parameters into
    host memory (JAX's CPU device) instead of the first accelerator, as tensor parallelism wants: they go
    from there straight to their shards, so a model larger than one GPU can be loaded."""
    if isinstance(model, LoadedModel):
        return model
    if host:
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            return load(model, dtype)
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

    def __init__(self, cfg: ModelConfig, params: Any, *, max_len: int, block_size: int = 16, kv_dtype=None,
                 kernel_impl: str = "auto", interpret: bool = False):
        self.kernels = dict(kernel_impl=kernel_impl, interpret=interpret)
        self.cfg, self.params = cfg, pack_params(params)
        self.block_size = block_size
        self.max_blocks = _bucket(-(-max_len // block_size), minimum=1)
        kv_dtype = kv_dtype or params["embed"].dtype
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
        logits, self.state = _step(
            self.cfg, self.params, self.state, batch, decode=decode, all_logits=all_logits, **self.kernels
        )
        return logits[:n] if all_logits else logits[0]


def generate(
    model: str | os.PathLike | LoadedModel,
    prompts: Sequence[str | Sequence[int]],
    *,
    max_tokens: int = 16,
    temperature: float = 0.0,
    dtype: str | None = None,
    seed: int = 0,
    ignore_eos: bool = False,
    max_num_batched_tokens: int | None = None,
):
    """Generates a continuation of each prompt (a string, or a list of token ids): a thin wrapper over
    `jhybrid.LLM`. Greedy when `temperature == 0`. Stops at `max_tokens` or at an EOS id of the checkpoint
    (config / generation_config.json) unless `ignore_eos`. Raises ValueError if any prompt is invalid.
    """
    from jhybrid.engine.llm import LLM
    from jhybrid.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos, seed=seed)
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]  # one prompt given bare
    m = load(model, dtype)
    lengths = [len(p) if not isinstance(p, str) else (len(m.tokenizer.encode(p)) if m.tokenizer else 1) for p in prompts]
    context = m.cfg.max_position_embeddings
    needed = max(lengths, default=1) + max_tokens
    if needed > context:
        raise ValueError(f"prompt ({max(lengths)} tokens) + max_tokens ({max_tokens}) exceeds the model's context ({context})")
    max_model_len = min(context, _bucket(needed, minimum=64))
    llm = LLM(m, dtype=None, max_num_seqs=min(16, max(1, len(prompts))), max_model_len=max_model_len, seed=seed,
              max_num_batched_tokens=max_num_batched_tokens)
    outputs = llm.generate(list(prompts), params)
    for i, out in enumerate(outputs):
        if out.error:
            raise ValueError(f"prompt {i}: {out.error}")
    return outputs
