"""Readers of compiled HLO text: what tests and scripts check about the programs XLA builds around our ops
(no communication under the supported shardings, caches updated in place)."""

from __future__ import annotations

import re

COLLECTIVE_OPS = ("all-gather", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute",
                  "collective-broadcast", "reduce-scatter")
_COLLECTIVE_RE = re.compile(r"\s(" + "|".join(COLLECTIVE_OPS) + r")(?:-start)?\(")
_ALIAS_RE = re.compile(r"\}: \((\d+), \{[\d,]*\}, (?:may|must)-alias\)")


def _text(hlo) -> str:
    return hlo if isinstance(hlo, str) else hlo.as_text()


def collectives_in(hlo) -> list:
    """Collective ops (all-gather, all-reduce, …) among the instructions of compiled HLO text (or a Compiled)."""
    return _COLLECTIVE_RE.findall(_text(hlo))


def custom_call_operand(hlo, target: str, index: int) -> tuple:
    """(name, shape) of the instruction that feeds operand `index` of the custom call to `target`."""
    text = _text(hlo)
    call = re.search(r"custom-call\(([^)]*)\), custom_call_target=\"" + re.escape(target) + '"', text)
    if call is None:
        raise ValueError(f"no custom call to {target!r} in the HLO (the kernel path was not lowered)")
    operands = call.group(1)
    name = re.findall(r"%[\w.-]+", operands)[index]
    dims = re.search(re.escape(name) + r" = \w+\[([\d,]*)\]", text).group(1)
    return name, tuple(int(d) for d in dims.split(",") if d)


def ops_producing(hlo, shape) -> set:
    """Opcodes of every instruction, in any computation, whose result has `shape` (any dtype)."""
    dims = ",".join(map(str, shape))
    return set(re.findall(r"= \w+\[" + dims + r"\]\{[\d,]*\} ([\w-]+)\(", _text(hlo)))


def params_aliased(hlo, shape) -> bool:
    """Every entry parameter of `shape` is aliased to an output (its donation was honoured), and there is one."""
    text = _text(hlo)
    aliased = {int(p) for p in _ALIAS_RE.findall(text.split("\n", 1)[0])}
    entry = text[text.index("\nENTRY "):]
    dims = ",".join(map(str, shape))
    params = {int(p) for p in re.findall(r"= \w+\[" + dims + r"\]\{[\d,]*\} parameter\((\d+)\)", entry)}
    return bool(params) and params <= aliased
