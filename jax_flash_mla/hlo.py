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


def computations(hlo) -> dict:
    """Computation name (without the %) -> its instruction lines, from compiled HLO text (or a Compiled)."""
    blocks, name = {}, None
    for line in _text(hlo).splitlines():
        head = re.match(r"(?:ENTRY )?%?([\w.-]+) \(.*\) -> .*\{\s*$", line)
        if head:
            name = head.group(1)
            blocks[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            blocks[name].append(line)
    return blocks


def _instruction(line: str):
    """(name, result type, opcode, operand names, argument text, attribute text) of an HLO instruction line, or
    None for other lines."""
    head = re.match(r"\s*(?:ROOT )?(%[\w.-]+) = (.*)$", line)
    if head is None:
        return None
    name, rest = head.groups()
    if rest.startswith("("):  # a tuple's type: up to its closing parenthesis
        depth = 0
        for end, char in enumerate(rest):
            depth += (char == "(") - (char == ")")
            if depth == 0:
                break
        result, rest = rest[:end + 1], rest[end + 2:]
    else:
        result, rest = rest.split(" ", 1)
    opcode, arguments = rest.split("(", 1)
    arguments, attributes = arguments.split(")", 1)
    return name, result, opcode, re.findall(r"%[\w.-]+", arguments), arguments, attributes


def custom_call_operand_chain(hlo, target: str, index: int) -> list:
    """(name, shape) of what feeds operand `index` of the custom call to `target`, followed outward: where that is a
    parameter of a computation one other instruction calls (XLA:GPU puts kernels in command buffers, `call`s of
    their own computation), the caller's operand next, and through bitcasts (views of the same bytes) to what they
    view, until an instruction that computes or a parameter of the entry or a loop body."""
    parsed = {c: [i for i in map(_instruction, lines) if i is not None] for c, lines in computations(hlo).items()}
    found = [(c, i) for c, body in parsed.items() for i in body
             if i[2] == "custom-call" and f'custom_call_target="{target}"' in i[5]]
    if not found:
        raise ValueError(f"no custom call to {target!r} in the HLO (the kernel path was not lowered)")
    computation, call = found[0]
    name, chain = call[3][index], []
    while True:
        _, result, opcode, operands, arguments, _ = next(i for i in parsed[computation] if i[0] == name)
        dims = re.match(r"\w+\[([\d,]*)\]", result).group(1)
        chain.append((name, tuple(int(d) for d in dims.split(",") if d)))
        if opcode == "bitcast":
            name = operands[0]
            continue
        callers = [(c, i) for c, body in parsed.items() for i in body
                   if re.search(r"(?:to_apply|calls)=%?" + re.escape(computation) + r"(?![\w.-])", i[5])]
        if opcode != "parameter" or len(callers) != 1:
            return chain
        computation, caller = callers[0]
        name = caller[3][int(arguments)]


def opcode(hlo, name: str) -> str:
    """The opcode of the instruction `name` (with its %; HLO names are unique in a module)."""
    for lines in computations(hlo).values():
        for i in filter(None, map(_instruction, lines)):
            if i[0] == name:
                return i[2]
    raise ValueError(f"no instruction {name!r} in the HLO")


def custom_call_operand(hlo, target: str, index: int) -> tuple:
    """(name, shape) of the instruction that feeds operand `index` of the custom call to `target`, through the
    computations that wrap the call (custom_call_operand_chain's last entry)."""
    return custom_call_operand_chain(hlo, target, index)[-1]


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
