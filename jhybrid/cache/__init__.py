"""Caches: the device state pytree and the host allocators that hand out its pages and slots."""

from jhybrid.cache.allocator import BlockAllocator, SlotAllocator
from jhybrid.cache.state import CacheConfig, HybridState, init_state, zero_slots

__all__ = ["BlockAllocator", "CacheConfig", "HybridState", "SlotAllocator", "init_state", "zero_slots"]
