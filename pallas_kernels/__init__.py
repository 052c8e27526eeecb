"""Kernels for hybrid-model inference: paged attention and the gated delta rule.

Each op comes as a pure-jnp reference (`*_reference`) and, where written, a Pallas GPU kernel behind the
same signature. See README.md for the dimension letters and sentinels.
"""

from pallas_kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_reference,
    fused_recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_reference,
)
from pallas_kernels.paged_attention import (
    paged_attention,
    paged_attention_reference,
    write_kv_pages,
)

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_reference",
    "fused_recurrent_gated_delta_rule",
    "paged_attention",
    "paged_attention_reference",
    "recurrent_gated_delta_rule_reference",
    "write_kv_pages",
]
