"""A conversion plan: for every jhybrid parameter, the on-disk tensors it is built from and how.

A plan is checked against the checkpoint's tensor names and shapes before any data is read, so a wrong
checkpoint fails fast (and `jhybrid inspect` can validate from headers alone). All problems are
collected and reported together.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import numpy as np


class ConversionError(ValueError):
    """A checkpoint does not match what its config implies (missing / unexpected / mis-shaped tensors,
    unsupported model type). `problems` lists each issue on its own."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = list(problems or [message])


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one jhybrid parameter is built.

    Attributes:
      sources: on-disk tensor names (after prefix normalisation), in the order `build` takes them.
      source_shapes: the shape each source must have, implied by the config.
      build: numpy arrays (one per source) -> the jhybrid array.
    """

    sources: tuple[str, ...]
    source_shapes: tuple[tuple[int, ...], ...]
    build: Callable[..., np.ndarray]


Plan = dict[str, Rule]  # jhybrid flat dotted name -> Rule


def identity(shape: tuple[int, ...], name: str) -> Rule:
    """Stored as is (norms, embeddings, biases, A_log, dt_bias)."""
    return Rule((name,), (tuple(shape),), lambda w: w)


def linear(shape_in_out: tuple[int, int], name: str) -> Rule:
    """A torch Linear weight `[out, in]` -> jhybrid `[in, out]`."""
    d_in, d_out = shape_in_out
    return Rule((name,), ((d_out, d_in),), lambda w: w.T)


def format_problems(what: str, problems: list[str], limit: int = 12) -> str:
    lines = [f"{what} ({len(problems)} problem{'s' * (len(problems) != 1)}):"]
    lines += [f"  - {p}" for p in problems[:limit]]
    if len(problems) > limit:
        lines.append(f"  ... and {len(problems) - limit} more")
    return "\n".join(lines)


def check_plan(plan: Plan, disk_shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """Checks that the plan's sources are exactly the on-disk tensors, with the expected shapes.

    Args:
      plan: from `name_maps.build_plan`.
      disk_shapes: `{normalised on-disk name: shape}` of every tensor that is not ignored.
      where: the checkpoint path, for the message.

    Raises:
      ConversionError: naming every missing, unexpected or mis-shaped tensor.
    """
    problems: list[str] = []
    used: set[str] = set()
    for jname, rule in plan.items():
        for src, expected in zip(rule.sources, rule.source_shapes):
            used.add(src)
            found = disk_shapes.get(src)
            if found is None:
                problems.append(f"missing tensor {src!r} (needed for {jname}, expected shape {expected})")
            elif tuple(found) != tuple(expected):
                problems.append(
                    f"tensor {src!r} has the wrong shape: expected {tuple(expected)}, found {tuple(found)} "
                    f"(needed for {jname})"
                )
    for name in sorted(set(disk_shapes) - used):
        problems.append(
            f"unexpected tensor {name!r} with shape {tuple(disk_shapes[name])}: the config's layout has no "
            "place for it (does config.json belong to these weights?)"
        )
    if problems:
        raise ConversionError(format_problems(f"{where}: checkpoint does not match its config.json", problems), problems)


def array_module(x):
    """numpy for a host array, `jax.numpy` for a device one: rules run on host arrays, and on device arrays
    where the loader dequantizes FP8 weights on the device (converters/fp8.py)."""
    if isinstance(x, np.ndarray):
        return np
    import jax.numpy as jnp

    return jnp


def apply_rule(jname: str, rule: Rule, arrays: list, expected: tuple[int, ...]):
    """Runs `rule.build`, checking the result has the jhybrid shape. Host arrays in, a numpy array out; device
    (JAX) arrays in, a device array out."""
    out = rule.build(*arrays)
    out = out if array_module(out) is not np else np.asarray(out)
    if out.shape != tuple(expected):  # only reachable through a bug in a name map
        raise ConversionError(f"{jname}: conversion produced shape {out.shape}, expected {tuple(expected)}")
    return out
