"""Compilation bookkeeping: JAX's persistent compilation cache, and a counter of the programs a process
compiles (or loads from that cache).

    enable_compilation_cache()            # ~/.cache/jhybrid/jax (or $XDG_CACHE_HOME/jhybrid/jax)
    watch = CompileWatch()                # counts every XLA compilation from now on, in any thread
    ...; watch.count, watch.seconds; watch.close()

`CompileWatch` listens to JAX's own monitoring event for backend compilation, which fires for every program
XLA builds or takes from the persistent cache (jit, AOT `.compile()`, eager ops alike), so a test or a
server can assert that nothing compiled after start-up without knowing which functions might.
"""

from __future__ import annotations

import logging
import os
import threading

import jax
from jax import monitoring

log = logging.getLogger("jhybrid.engine")

# the event JAX records around each backend compilation (jax._src.dispatch.BACKEND_COMPILE_EVENT)
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def default_cache_dir() -> str:
    """Where `jhybrid serve` keeps compiled programs unless told otherwise."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jhybrid", "jax")


def enable_compilation_cache(path: str | None = None) -> str:
    """Turns on JAX's persistent compilation cache in `path` (created if missing; default
    `default_cache_dir()`) for every program, however quick to compile, so a second start of the same
    engine loads its programs from disk, and the step-program cache of engines built from now on
    (`jhybrid.engine.program_cache`, in `path`/programs: a start finds them without tracing). Process-wide (a JAX
    setting). Returns the folder."""
    path = os.path.abspath(os.path.expanduser(path or default_cache_dir()))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    global program_cache_dir
    program_cache_dir = os.path.join(path, "programs")
    log.info("JAX compilation cache: %s", path)
    return path


# where engines built from now on keep their step programs' executables (`jhybrid.engine.program_cache`), set by
# `enable_compilation_cache`; None: no such cache
program_cache_dir: str | None = None


class CompileWatch:
    """Counts XLA compilations (and persistent-cache loads) in this process while it is open, and keeps the name
    JAX gives each (`jit(copy_slots)`, `jit(convert_element_type)` for an eager op: `names`, in order). With
    `warn`, each one is also logged as a warning naming it and `warn` (what was expected not to compile). Compiles on
    threads whose names start with `background` (work meant to stay off the request path) count in `background`
    only."""

    def __init__(self, warn: str | None = None, background: str | None = None):
        self._lock = threading.Lock()
        self._background = background  # a thread-name prefix: those threads' compiles count in `background` only
        self.background = 0
        self.count = 0
        self.seconds = 0.0
        self.names: list[str] = []
        self._warn = warn
        self._open = True
        monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT and self._open:
            name = str(kwargs.get("fun_name", "?"))
            if self._background and threading.current_thread().name.startswith(self._background):
                with self._lock:
                    self.background += 1
                return
            with self._lock:
                self.count += 1
                self.seconds += duration
                self.names.append(name)
            if self._warn:
                log.warning("compiled %s (%.2f s) %s", name, duration, self._warn)

    def close(self) -> None:
        if self._open:
            self._open = False
            monitoring.unregister_event_duration_listener(self._on_event)

    def __enter__(self) -> "CompileWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
