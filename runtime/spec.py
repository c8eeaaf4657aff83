"""One description of "a runtime that translates", shared by our backends and the benchmark's peers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeSpec:
    name: str  # the id used on command lines, in the API and in result files
    label: str  # how screens and reports name it
    colour: str  # its colour in every chart, so one runtime looks the same everywhere
    precision: str  # "fp32", "fp16" or "int8": what its weights and arithmetic are
    exact: bool  # expected token-identical to generate() (False: reduced precision, compared as agreement)


def expect_one_of(kind: str, name: str, known) -> None:
    """Raise ValueError naming the valid choices when `name` is not among `known`."""
    if name not in known:
        raise ValueError(f"unknown {kind} {name!r}; expected one of: {', '.join(known)}")
