"""Step programs kept on disk as executables, found again without tracing them.

JAX's persistent compilation cache is keyed by the lowered program, so a cached start still traces and lowers
every step program before it can look one up, and on the H200 that Python work was most of a cached `jhybrid
serve` start (benchmarks/RESULTS.md, "Session 18"). This cache is keyed by what the program is made from instead,
so a hit skips tracing:

* the code: a digest of every source file of `jhybrid` and `pallas_kernels`;
* the toolchain and the machine: jax and jaxlib versions, the backend, the kinds and number of devices;
* the settings a trace reads: every upper-case constant of a loaded `jhybrid` / `pallas_kernels` module (kernel
  and sampler switches, tile sizes: a switch set at run time changes the key), jax's configuration (caches and
  logging aside), and the environment's `JHYBRID_*`, `XLA_*` and `JAX_*` variables (cache folders aside);
* the program: the runner's static arguments (model config, bucket, row and block limits, XLA options) and the
  shape, dtype and sharding of every argument (weights, state, tables).

Anything else a trace could read is a bug of this list, so the cache is used where the gain is large and the
start is a server's: engines built after `enable_compilation_cache` (what `jhybrid serve` calls unless
`--no-compilation-cache`), on one GPU. Not on the CPU: XLA:CPU crashes (a segmentation fault) running the second of
two step executables deserialised in one process (one alone runs right). Entries live under the compilation cache
folder (`programs/`), one file each, written atomically; a file that does not load is ignored and rebuilt.
`benchmarks/program_cache_check.py` checks on the device that a process that loads every step program generates the
tokens of the process that compiled them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import sys
import tempfile
from functools import lru_cache

import jax

log = logging.getLogger("jhybrid.engine")

_PACKAGES = ("jhybrid", "pallas_kernels")
_SKIP_ENV = ("JAX_COMPILATION_CACHE_DIR", "JHYBRID_TEST_RUN", "JHYBRID_ENGINE_SETUP", "JHYBRID_ENGINE_SYS_PATH")


@lru_cache(maxsize=1)
def _code_digest() -> str:
    digest = hashlib.sha256()
    for package in _PACKAGES:
        module = sys.modules.get(package) or __import__(package)
        for root in module.__path__:
            for folder, dirs, files in os.walk(root):
                dirs.sort()
                for name in sorted(files):
                    if name.endswith(".py"):
                        path = os.path.join(folder, name)
                        digest.update(os.path.relpath(path, root).encode())
                        with open(path, "rb") as f:
                            digest.update(f.read())
    return digest.hexdigest()


def _plain(value) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool))


def _canonical(value) -> str:
    """repr, with sets in sorted order (a set's order changes with the process's hash seed)."""
    if isinstance(value, frozenset):
        return "frozenset(" + repr(sorted(map(_canonical, value))) + ")"
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_canonical, value)) + ")"
    return repr(value)


def _switches() -> list[tuple[str, str]]:
    """Upper-case constants of the loaded modules of this project, by module and name."""
    out = []
    for name, module in sorted(sys.modules.items()):
        if module is None or name.split(".")[0] not in _PACKAGES:
            continue
        for attr, value in sorted(vars(module).items()):
            if attr.isupper() and _plain(value):
                out.append((f"{name}.{attr}", _canonical(value)))
    return out


def context() -> list:
    """What every key shares: code, toolchain, devices, switches, jax's configuration, environment."""
    devices = jax.devices()
    config = sorted((k, _canonical(v)) for k, v in jax.config.values.items()
                    if "cache" not in k and "log" not in k and _plain(v))
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith(("JHYBRID_", "XLA_", "JAX_")) and k not in _SKIP_ENV)
    import jaxlib

    return [_code_digest(), jax.__version__, jaxlib.__version__, jax.default_backend(),
            [d.device_kind for d in devices], _switches(), config, env]


def _aval(x) -> tuple:
    return tuple(x.shape), str(x.dtype), repr(getattr(x, "sharding", None))


class ProgramCache:
    """Executables on disk under `folder`, keyed as the module docstring says."""

    def __init__(self, folder: str):
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        self.hits = self.misses = 0
        self._context = context()

    def key(self, static: tuple, args) -> str:
        leaves, treedef = jax.tree.flatten(args)
        text = repr((self._context, static, str(treedef), [_aval(x) for x in leaves]))
        return hashlib.sha256(text.encode()).hexdigest()

    def _path(self, key: str) -> str:
        return os.path.join(self.folder, f"{key}.exec")

    def load(self, key: str):
        """The program stored under `key`, or None (absent, or not loadable here)."""
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self._path(key)
        if not os.path.exists(path):
            self.misses += 1
            return None
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            program = deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # a truncated or foreign file: compile instead (and overwrite it)
            log.warning("step program cache: %s does not load (%s: %s); compiling it", path, type(e).__name__, e)
            self.misses += 1
            return None
        self.hits += 1
        return program

    def store(self, key: str, program) -> None:
        from jax.experimental.serialize_executable import serialize

        try:
            data = pickle.dumps(serialize(program))
        except Exception as e:  # not serialisable on this backend: the JAX cache still has it
            log.warning("step program cache: cannot store a program (%s: %s)", type(e).__name__, e)
            return
        fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, self._path(key))
