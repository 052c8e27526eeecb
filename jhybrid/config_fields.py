"""Which fields of an HF `config.json` a reader understands; everything else is refused, by name.

A field no reader knows may change the model (a new layer option, a quantization scheme, another family's
field under a renamed `model_type`), so `check_fields` raises a `ValueError` naming it rather than building a
model that silently differs from the checkpoint. Each reader passes the fields it reads (and validates);
`NEUTRAL` fields (HF bookkeeping, training-only settings, generation defaults) never change inference; fields
*ignored on purpose* (a vision tower, M-RoPE sections, multi-token-prediction heads) are logged once, at INFO
on the `jhybrid.config` logger, and returned by `jhybrid.config.ignored_fields` (for `jhybrid inspect`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

log = logging.getLogger("jhybrid.config")

# HF bookkeeping, training-only settings and generation defaults (older transformers wrote those into
# config.json): none changes the logits of a forward pass.
NEUTRAL = frozenset({
    "architectures", "transformers_version", "_name_or_path", "auto_map", "use_cache", "initializer_range",
    "attention_dropout", "hidden_dropout", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
    "output_attentions", "output_hidden_states", "return_dict", "torchscript", "use_bfloat16", "tf_legacy_loss",
    "pruned_heads", "id2label", "label2id", "problem_type", "finetuning_task", "task_specific_params", "prefix",
    "tokenizer_class", "is_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "tie_encoder_decoder", "chunk_size_feed_forward", "decoder_start_token_id", "sep_token_id",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
})

# rope_parameters / rope_scaling keys the readers understand (config.py `_rope`); M-RoPE keys are ignored on purpose
ROPE_KEYS = frozenset({
    "rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings",
})
MROPE_KEYS = frozenset({"mrope_section", "mrope_interleaved"})
MROPE_REASON = "M-RoPE sections: text-only positions are equal in all three sections, where M-RoPE is 1-D RoPE"
# set by `ignored_fields` while it collects instead of logging
_SINK: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("jhybrid_ignored_fields", default=None)
MTP_REASON = "multi-token-prediction head: jhybrid does not run it (its mtp.* weights are not loaded)"


def check_fields(
    where: str,
    hf: Mapping[str, Any],
    read: Iterable[str],
    ignored: Mapping[str, str] | None = None,
    hints: Mapping[frozenset[str], str] | None = None,
) -> None:
    """Raises `ValueError` naming every field of `hf` that is neither read, neutral nor ignored on purpose.

    Args:
      where: the reader, for the message (e.g. "qwen3_5_moe text_config").
      hf: the config dict (one level: a nested `text_config` is checked by its own call).
      read: fields the reader reads and validates.
      ignored: `{field: why}` for fields ignored on purpose; logged once (see `log_ignored`).
      hints: `{fields: explanation}`: when the unknown fields meet one of these sets, the explanation (what
        the config probably is, and what to do) is added to the message.
    """
    known = NEUTRAL | set(read) | set(ignored or ())
    unknown = sorted(k for k in hf if k not in known)
    if unknown:
        notes = [why for fields, why in (hints or {}).items() if fields & set(unknown)] or [
            "Check the model_type; a field at its neutral value can be removed."]
        raise ValueError(
            f"{where}: config field(s) {', '.join(unknown)} are not read by jhybrid and may change the model, so it "
            f"will not build one without them. {' '.join(notes)}"
        )
    report_ignored(where, hf, {k: why for k, why in (ignored or {}).items() if k in hf})


def check_rope_keys(where: str, hf: Mapping[str, Any], rope: Mapping[str, Any]) -> None:
    """Raises naming unknown keys of `hf`'s merged rope_parameters/rope_scaling dict; reports the M-RoPE ones."""
    unknown = sorted(k for k in rope if k not in ROPE_KEYS | MROPE_KEYS)
    if unknown:
        raise ValueError(f"{where}: rope_parameters key(s) {', '.join(unknown)} are not supported")
    report_ignored(where, hf, {f"rope_parameters.{k}": MROPE_REASON for k in sorted(MROPE_KEYS & set(rope))})


@functools.lru_cache(maxsize=256)  # "once": the same config is read several times per load (convert, engine)
def log_ignored(where: str, config_key: str, items: tuple[tuple[str, str], ...]) -> None:
    by_reason: dict[str, list[str]] = {}
    for k, why in items:
        by_reason.setdefault(why, []).append(k)
    log.info("%s: ignoring %s", where, "; ".join(f"{', '.join(ks)} ({why})" for why, ks in by_reason.items()))


def report_ignored(where: str, hf: Mapping[str, Any], present: Mapping[str, str]) -> None:
    """Logs `{field: why}` of config `hf` once, or hands it to `ignored_fields` when that is collecting."""
    sink = _SINK.get()
    if sink is not None:
        sink.update(present)
    elif present:
        key = hashlib.sha1(json.dumps(hf, sort_keys=True, default=str).encode()).hexdigest()
        log_ignored(where, key, tuple(sorted(present.items())))


@contextlib.contextmanager
def collect_ignored() -> Iterator[dict[str, str]]:
    """Within the block, readers add `{field: why}` to the yielded dict instead of logging (see
    `jhybrid.config.ignored_fields`)."""
    sink: dict[str, str] = {}
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)


# ----------------------------------------------------------------------------- quantization_config
# Block-wise FP8 as transformers' `FineGrainedFP8Config` reads it (Qwen3-Next-80B-A3B-Instruct-FP8, DeepSeek-V3
# style): e4m3 weights `W [out, in]` with fp32 `weight_scale_inv [ceil(out/b0), ceil(in/b1)]`, W ~ W_fp8 * scale
# per block; jhybrid dequantizes them at load (converters/fp8.py). Fields whose values jhybrid cannot honour
# raise, naming them.
FP8_SUPPORTED = {
    "quant_method": ("fp8",),
    "fmt": ("e4m3",),  # DeepSeek's field; transformers assumes e4m3
    "activation_scheme": ("dynamic",),  # "static" ships activation scales for FP8 matmuls that are not run here
    "scale_fmt": ("float",),  # "ue8m0" (power-of-two scales in one byte) is not read
    "expert_dtype": ("fp8",),  # "fp4": DeepSeek-V4's packed FP4 experts
}
FP8_FIELDS = frozenset(FP8_SUPPORTED) | {
    "weight_block_size", "modules_to_not_convert", "ignored_layers", "modules_to_convert", "dequantize"}


def read_quantization_config(hf: Mapping[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config`, validated: `{"quant_method": "fp8", "weight_block_size": (b0, b1),
    "modules_to_not_convert": (...)}`, or None when there is none.

    Raises:
      ValueError: another method, or a field or value jhybrid cannot honour (named), with what it supports.
    """
    q = hf.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise ValueError(f"quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"quantization_config.quant_method={method!r} is not supported: jhybrid loads block-wise FP8 checkpoints "
            "(quant_method 'fp8', e4m3 weights with weight_scale_inv per block) and unquantized ones; use the "
            "checkpoint's bf16 release"
        )
    where = "quantization_config (fp8)"
    if unknown := sorted(set(q) - FP8_FIELDS):
        raise ValueError(f"{where}: field(s) {', '.join(unknown)} are not read by jhybrid; known: {sorted(FP8_FIELDS)}")
    for field, allowed in FP8_SUPPORTED.items():
        if field in q and q[field] not in allowed:
            raise ValueError(f"{where}: {field}={q[field]!r} is not supported (supported: {', '.join(map(repr, allowed))})")
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(
            f"{where}: weight_block_size={block!r} is not supported: jhybrid reads block-wise scales, "
            "weight_block_size [rows, cols] of two positive integers (per-tensor FP8 is not supported)"
        )
    if q.get("modules_to_convert"):
        raise ValueError(f"{where}: modules_to_convert={q['modules_to_convert']!r} (FP8 embeddings) is not supported")
    if "dequantize" in q and not isinstance(q["dequantize"], bool):
        raise ValueError(f"{where}: dequantize={q['dequantize']!r} must be true or false")
    skip = q.get("modules_to_not_convert", q.get("ignored_layers")) or ()
    if not (isinstance(skip, (list, tuple)) and all(isinstance(s, str) for s in skip)):
        raise ValueError(f"{where}: modules_to_not_convert={skip!r} must be a list of module names")
    return {"quant_method": "fp8", "weight_block_size": tuple(block), "modules_to_not_convert": tuple(skip)}
