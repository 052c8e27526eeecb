"""A request as the engine tracks it (host only, no JAX)."""

from __future__ import annotations

import enum
import itertools
from typing import Any

from jhybrid.cache.prefix_cache import PrefixCursor
from jhybrid.engine.sampling import FLAG_ALLOWED, FLAG_BANS, FLAG_BIAS, FLAG_MASKED, FLAG_PENALTIES, SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt and generated tokens, where its KV and state live, and how far the model has read it.

    `token_ids` = prompt + generated tokens known on the host. `num_computed` counts tokens already fed
    to the model (their KV / state is on the device). `num_pending` counts tokens sampled on the device
    whose value the host has not read yet (the engine reads one step behind); each pending token will be
    fed back from the device, so scheduling treats it as known.
    """

    def __init__(self, request_id: Any, prompt_ids: list[int], params: SamplingParams, arrival: int = 0):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.token_ids = list(prompt_ids)
        self.params = params
        self.arrival = arrival
        self.status = Status.WAITING
        self.block_table: list[int] = []  # device blocks, for positions from len(host_blocks) * block_size on
        self.host_blocks: list[int] = []  # offloaded (kv_offload): host blocks of the oldest positions
        self.slot: int = 0
        self.num_computed = 0
        self.num_pending = 0
        self.num_preemptions = 0
        self.prefix = PrefixCursor()  # its place in the prefix cache (`jhybrid.cache.prefix_cache`)
        self.num_cached_tokens: int | None = None  # prompt tokens reused from the prefix cache at admission
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.logprobs: list[dict[int, float]] = []
        self.token_logprobs: list[float] = []
        # per prompt position when `params.prompt_logprobs` is set: None at 0, then {token id: logprob} (the
        # prompt token and the top-k), filled as prefill steps are read (None where not read yet)
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] * len(prompt_ids) if params.prompt_logprobs is not None else None)
        # which per-slot sampling tables the sequence reads (`jhybrid.engine.slot_tables`); FLAG_BANS with `set_bans`
        self.flags = ((FLAG_PENALTIES if params.penalised else 0) | (FLAG_ALLOWED if params.allowed_token_ids else 0)
                      | (FLAG_BIAS if params.logit_bias else 0))
        self.bans: Any = None  # [n, MAX_BAN_TOKENS + 1] int32 entries (`slot_tables.ban_rows`) or None
        self.ban_window = False  # some banned sequence has more than one token: steps send the output's end
        self.detok: Any = None  # IncrementalDetokenizer when a tokenizer exists
        # structured output: the grammar matcher (`jhybrid.engine.structured_output.Matcher`), advanced by each
        # output token the host reads; freed when the sequence finishes. Its row flag is FLAG_MASKED.
        self.matcher: Any = None
        self.text = ""
        self.stop_text_floor = 0  # stop strings must end past this much text (that of the first min_tokens tokens)
        self.sent_text_len = 0  # how much of `text` has been streamed

    def set_bans(self, rows) -> None:
        """The banned token sequences (bad words; stop ids before min_tokens) as `slot_tables.ban_rows` makes them."""
        if len(rows):
            self.bans, self.flags = rows, self.flags | FLAG_BANS
            self.ban_window = bool((rows[:, :-2] >= 0).any())

    def set_matcher(self, matcher) -> None:
        """Constrains the output to a grammar (`jhybrid.engine.structured_output.Matcher`)."""
        self.matcher, self.flags = matcher, self.flags | FLAG_MASKED

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def num_tokens(self) -> int:
        """Tokens the model will have seen once every pending token is fed back."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_generated(self) -> int:
        return self.num_tokens - len(self.prompt_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, {self.status.value}, tokens={len(self.token_ids)}"
            f"+{self.num_pending}, computed={self.num_computed}, blocks={len(self.block_table)}"
            f"{f'+{len(self.host_blocks)} host' if self.host_blocks else ''}, slot={self.slot})"
        )
