"""Prometheus metrics of one served engine, in a registry of their own (no global registry).

Names follow vLLM's with a `jhybrid:` prefix, so dashboards carry over:

| metric | kind | what |
|---|---|---|
| `jhybrid:time_to_first_token_seconds` | histogram | request arrival -> its first token reaches the server |
| `jhybrid:inter_token_latency_seconds` | histogram | gap between a request's successive tokens |
| `jhybrid:e2e_request_latency_seconds` | histogram | arrival -> finish (stop / length) |
| `jhybrid:num_requests_running` / `_waiting` | gauge | scheduler queues (waiting includes requests queued for the engine thread) |
| `jhybrid:num_requests_preempted` | gauge | waiting requests that were preempted (and will re-prefill) |
| `jhybrid:num_preemptions_total` | counter | preemptions so far |
| `jhybrid:kv_blocks_used` / `_total`, `jhybrid:kv_cache_usage_perc` | gauge | paged KV pool (null block excluded) |
| `jhybrid:state_slots_used` / `_total`, `jhybrid:state_slot_usage_perc` | gauge | linear-layer state slots (null slot excluded) |
| `jhybrid:prompt_tokens_total`, `jhybrid:generation_tokens_total` | counter | tokens admitted / generated |
| `jhybrid:host_kv_blocks_used` / `_total`, `jhybrid:host_state_slots_used` / `_total`, `jhybrid:host_tier_bytes_used` / `_total` | gauge | host tier (0 without one) |
| `jhybrid:preemptions_by_mode_total{mode}` | counter | preemptions by `swap` / `recompute` |
| `jhybrid:swap_bytes_total{direction}`, `jhybrid:swaps_total{direction}` | counter | KV + state moved `out` (device -> host) / `in` |
| `jhybrid:swap_seconds_total{direction}` | counter | host time spent dispatching and storing swaps |
| `jhybrid:host_resident_kv_blocks` | gauge | KV blocks of running sequences held in the host tier (`kv_offload`) |
| `jhybrid:offloaded_kv_blocks_total`, `jhybrid:offload_bytes_total` | counter | blocks (bytes) moved device -> host by offloading |
| `jhybrid:offloads_declined_total` | counter | offloads the cost model priced above the preemption they would avoid |
| `jhybrid:offload_steps_total{path}` | counter | steps with host-KV rows (`host`) or without (`plain`) |
| `jhybrid:cpu_attention_calls_total`, `jhybrid:cpu_attention_seconds_total`, `jhybrid:cpu_attention_wait_seconds_total` | counter | CPU attention over host KV: calls, worker time, time the step waited |
| `jhybrid:offload_copy_bytes_total` | counter | `kv_offload="copy"`: host blocks copied to the device |
| `jhybrid:prefix_cache_queries_total`, `jhybrid:prefix_cache_hits_total` | counter | prefix caching: prompt tokens looked up at admission / found in the cache (vLLM's names) |
| `jhybrid:prefix_cache_snapshots_held` / `_total`, `jhybrid:prefix_cache_cached_blocks` | gauge | prefix caching: state snapshots held (of the pool), KV blocks indexed by content |
| `jhybrid:prefix_cache_host_blocks`, `jhybrid:prefix_cache_host_snapshots` | gauge | prefix caching with a host tier: cached blocks and snapshots held in host memory |
| `jhybrid:prefix_cache_host_blocks_demoted_total` / `_promoted_total`, `jhybrid:prefix_cache_host_snapshots_demoted_total`, `jhybrid:prefix_cache_host_restores_total` | counter | prefix caching with a host tier: blocks and snapshots moved there on eviction, blocks brought back and states restored from there by hits |
| `jhybrid:output_delivery_seconds{stage}` | histogram | a step's outputs on their way to the streams: `engine_to_server` (the engine loop's emit -> the server process's receiver: pickling, the pipe, the receiver's wait for the GIL), `server_queue` (the receiver -> the event loop running the hand-off to each stream) |
| `jhybrid:event_loop_lag_seconds` | histogram | how late the event loop runs a timer it set 5 ms ahead: the longest it leaves streams unserved |
| `jhybrid:request_success_total{finished_reason}` | counter | finished requests: stop, length, abort, error |
| `jhybrid:http_requests_total{method,route,status}` | counter | HTTP responses (rejections included) |
| `jhybrid:startup_programs_compiled`, `jhybrid:startup_compile_seconds` | gauge | programs compiled (or loaded) before ready, and the seconds it took |
| `jhybrid:programs_compiled_after_ready_total` | gauge | programs compiled after the server reported ready (each one stalled steps) |
| `jhybrid:engine_steps_total`, `jhybrid:engine_host_{schedule,prepare,postprocess}_seconds_total`, `jhybrid:engine_device_wait_seconds_total` | gauge | engine steps, the engine thread's host time per phase, and its time blocked on the device |

The request metrics (TTFT, ITL, end to end, tokens, finish reasons) are observed in the server process as each
delta arrives from the engine; the gauges and engine counters are set from the numbers the engine reports with
its outputs (`engine_core.engine_gauges`, every 50 ms while it steps). prometheus_client's metrics are
thread-safe, so scrapes read them directly.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0)
DELIVERY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015,
                    0.02, 0.03, 0.05, 0.1, 0.25, 1.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r, label = self.registry, {"model_name": model_name}

        def hist(name, doc, buckets):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(**label)

        def gauge(name, doc):
            return Gauge(name, doc, ["model_name"], registry=r).labels(**label)

        def counter(name, doc):
            return Counter(name, doc, ["model_name"], registry=r).labels(**label)

        self.ttft = hist("jhybrid:time_to_first_token_seconds", "Time to first token (s).", TTFT_BUCKETS)
        self.itl = hist("jhybrid:inter_token_latency_seconds", "Time between successive tokens of a request (s).", ITL_BUCKETS)
        self.e2e = hist("jhybrid:e2e_request_latency_seconds", "Request latency from arrival to finish (s).", E2E_BUCKETS)
        delivery = Histogram("jhybrid:output_delivery_seconds", "Engine emit -> server receiver (engine_to_server), "
                             "receiver -> event loop hand-off (server_queue) (s).", ["model_name", "stage"],
                             buckets=DELIVERY_BUCKETS, registry=r)
        self.delivery_pipe = delivery.labels(model_name=model_name, stage="engine_to_server")
        self.delivery_queue = delivery.labels(model_name=model_name, stage="server_queue")
        self.loop_lag = hist("jhybrid:event_loop_lag_seconds", "How late the event loop ran a timer (s).",
                             DELIVERY_BUCKETS)
        self.running = gauge("jhybrid:num_requests_running", "Requests being computed.")
        self.waiting = gauge("jhybrid:num_requests_waiting", "Requests waiting for admission.")
        self.preempted = gauge("jhybrid:num_requests_preempted", "Waiting requests that were preempted.")
        self.preemptions = counter("jhybrid:num_preemptions", "Preemptions (recompute) so far.")
        self.blocks_used = gauge("jhybrid:kv_blocks_used", "KV blocks in use.")
        self.blocks_total = gauge("jhybrid:kv_blocks_total", "KV blocks in the pool.")
        self.kv_usage = gauge("jhybrid:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).")
        self.slots_used = gauge("jhybrid:state_slots_used", "Linear-state slots in use.")
        self.slots_total = gauge("jhybrid:state_slots_total", "Linear-state slots in the pool.")
        self.slot_usage = gauge("jhybrid:state_slot_usage_perc", "Fraction of state slots in use (0..1).")
        self.prompt_tokens = counter("jhybrid:prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("jhybrid:generation_tokens", "Generated tokens.")
        success = Counter("jhybrid:request_success", "Finished requests by finish reason.",
                          ["model_name", "finished_reason"], registry=r)
        self.finished = {reason: success.labels(model_name=model_name, finished_reason=reason) for reason in FINISH_REASONS}
        self.http = Counter("jhybrid:http_requests", "HTTP responses by route and status.",
                            ["method", "route", "status"], registry=r)
        self._num_preemptions = 0
        host = {
            "host_blocks_used": ("jhybrid:host_kv_blocks_used", "Host-tier KV blocks in use."),
            "host_blocks_total": ("jhybrid:host_kv_blocks_total", "Host-tier KV blocks."),
            "host_slots_used": ("jhybrid:host_state_slots_used", "Host-tier state slots in use."),
            "host_slots_total": ("jhybrid:host_state_slots_total", "Host-tier state slots."),
            "host_bytes_used": ("jhybrid:host_tier_bytes_used", "Host-tier bytes in use (KV + state)."),
            "host_bytes_total": ("jhybrid:host_tier_bytes_total", "Host-tier bytes (KV + state)."),
        }
        host["host_resident_blocks"] = ("jhybrid:host_resident_kv_blocks",
                                        "KV blocks of running sequences held in the host tier (offloaded attention).")
        self.host_gauges = {key: gauge(name, doc) for key, (name, doc) in host.items()}
        by_mode = Counter("jhybrid:preemptions_by_mode", "Preemptions by mode (swap / recompute).",
                          ["model_name", "mode"], registry=r)
        swap_bytes = Counter("jhybrid:swap_bytes", "Bytes of KV + state swapped, by direction.",
                             ["model_name", "direction"], registry=r)
        swaps = Counter("jhybrid:swaps", "Sequences swapped, by direction.", ["model_name", "direction"], registry=r)
        swap_s = Counter("jhybrid:swap_seconds", "Host seconds spent on swaps, by direction.",
                         ["model_name", "direction"], registry=r)
        self.engine_counters = {
            "num_swap_preemptions": by_mode.labels(model_name=model_name, mode="swap"),
            "num_recompute_preemptions": by_mode.labels(model_name=model_name, mode="recompute"),
            "swap_out_bytes": swap_bytes.labels(model_name=model_name, direction="out"),
            "swap_in_bytes": swap_bytes.labels(model_name=model_name, direction="in"),
            "num_swap_out": swaps.labels(model_name=model_name, direction="out"),
            "num_swap_in": swaps.labels(model_name=model_name, direction="in"),
            "swap_out_seconds": swap_s.labels(model_name=model_name, direction="out"),
            "swap_in_seconds": swap_s.labels(model_name=model_name, direction="in"),
            "num_offloaded_blocks": counter("jhybrid:offloaded_kv_blocks", "KV blocks moved to the host tier by offloading."),
            "offload_bytes": counter("jhybrid:offload_bytes", "Bytes of KV moved to the host tier by offloading."),
            "num_offloads_declined": counter("jhybrid:offloads_declined",
                                             "Offloads priced above the preemption they would avoid (not done)."),
            "num_cpu_calls": counter("jhybrid:cpu_attention_calls", "CPU attention calls over host-resident KV."),
            "cpu_attention_seconds": counter("jhybrid:cpu_attention_seconds", "CPU attention worker seconds."),
            "cpu_wait_seconds": counter("jhybrid:cpu_attention_wait_seconds",
                                        "Seconds steps waited for CPU attention (not hidden by the GPU's work)."),
            "copy_bytes": counter("jhybrid:offload_copy_bytes", "Host KV bytes copied to the device (kv_offload='copy')."),
            "prefix_cache_queries": counter("jhybrid:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache at admission."),
            "prefix_cache_hits": counter("jhybrid:prefix_cache_hits", "Prompt tokens found in the prefix cache (reused)."),
            "prefix_blocks_demoted": counter("jhybrid:prefix_cache_host_blocks_demoted",
                                             "Cached KV blocks moved to the host tier when evicted from the device."),
            "prefix_blocks_promoted": counter("jhybrid:prefix_cache_host_blocks_promoted",
                                              "Cached KV blocks brought back from the host tier by a hit."),
            "prefix_snapshots_demoted": counter("jhybrid:prefix_cache_host_snapshots_demoted",
                                                "State snapshots moved to the host tier when evicted from the device."),
            "prefix_host_restores": counter("jhybrid:prefix_cache_host_restores",
                                            "Hits whose state was restored from a snapshot in the host tier."),
        }
        steps = Counter("jhybrid:offload_steps", "Steps with host-KV rows (host) or without (plain).",
                        ["model_name", "path"], registry=r)
        self.engine_counters["num_steps_host"] = steps.labels(model_name=model_name, path="host")
        self.engine_counters["num_steps_plain"] = steps.labels(model_name=model_name, path="plain")
        self._last: dict[str, float] = {}
        self.stat_gauges = {  # engine stats keys that are absent on engines without them read 0
            "startup_programs_compiled": gauge("jhybrid:startup_programs_compiled",
                                               "Programs compiled or loaded before the server reported ready."),
            "startup_compile_seconds": gauge("jhybrid:startup_compile_seconds",
                                             "Seconds spent compiling before the server reported ready."),
            "programs_compiled_after_ready": gauge("jhybrid:programs_compiled_after_ready_total",
                                                   "Programs compiled after the server reported ready."),
            "num_steps": gauge("jhybrid:engine_steps_total", "Engine steps run."),
            "prefix_snapshots_held": gauge("jhybrid:prefix_cache_snapshots_held",
                                           "Linear-state snapshots held by the prefix cache."),
            "prefix_snapshots_total": gauge("jhybrid:prefix_cache_snapshots_total", "Snapshot slots of the prefix cache."),
            "prefix_cached_blocks": gauge("jhybrid:prefix_cache_cached_blocks", "KV blocks indexed by the prefix cache."),
            "prefix_host_blocks": gauge("jhybrid:prefix_cache_host_blocks", "Cached KV blocks held in the host tier."),
            "prefix_host_snapshots": gauge("jhybrid:prefix_cache_host_snapshots",
                                           "State snapshots of the prefix cache held in the host tier."),
            "host_schedule_seconds": gauge("jhybrid:engine_host_schedule_seconds_total",
                                           "Engine-thread seconds spent scheduling steps."),
            "host_prepare_seconds": gauge("jhybrid:engine_host_prepare_seconds_total",
                                          "Engine-thread seconds spent building and dispatching steps."),
            "host_postprocess_seconds": gauge("jhybrid:engine_host_postprocess_seconds_total",
                                              "Engine-thread seconds spent reading tokens: detokenizing, stop checks."),
            "device_wait_seconds": gauge("jhybrid:engine_device_wait_seconds_total",
                                         "Engine-thread seconds spent waiting for a step's tokens."),
        }

    def observe_engine(self, engine, num_queued: int = 0) -> None:
        """Sets the gauges from an engine in this process; `num_queued` requests wait to be added."""
        from jhybrid.server.engine_core import engine_gauges

        self.set_engine_gauges(engine_gauges(engine), num_queued)

    def set_engine_gauges(self, values: dict[str, float], num_queued: int = 0) -> None:
        """Sets the gauges and engine counters from `engine_core.engine_gauges`' numbers (from this process or the
        engine process); `num_queued` requests wait to be added."""
        self.running.set(values["running"])
        self.waiting.set(values["waiting"] + num_queued)
        self.preempted.set(values["preempted"])
        blocks_total, slots_total = values["blocks_total"], values["slots_total"]
        self.blocks_used.set(values["blocks_used"])
        self.blocks_total.set(blocks_total)
        self.kv_usage.set(values["blocks_used"] / blocks_total)
        self.slots_used.set(values["slots_used"])
        self.slots_total.set(slots_total)
        self.slot_usage.set(values["slots_used"] / slots_total)
        if values["num_preemptions"] > self._num_preemptions:
            self.preemptions.inc(values["num_preemptions"] - self._num_preemptions)
            self._num_preemptions = values["num_preemptions"]
        for key, g in (*self.host_gauges.items(), *self.stat_gauges.items()):
            g.set(values.get(key, 0))
        for key, c in self.engine_counters.items():
            value = values.get(key, 0)
            if value > self._last.get(key, 0):
                c.inc(value - self._last.get(key, 0))
                self._last[key] = value

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
