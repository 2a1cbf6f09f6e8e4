"""Typed method options: each method declares one frozen dataclass `Options`, and
`parse_options` reads `--option key=value` pairs against it.

A field's annotation says what it takes: int, float, bool, str, tuple[int, ...] (nested
tuples too), Literal[...] choices, and unions of those with None. `option(default, min=,
max=, above=, choices=)` adds a range or choices. Values arrive as the CLI decodes them
(JSON where the text parses, else the string) or as Python values. Any bad key or value is
one BenchError line naming the method and listing its options, before a model loads.

The budget. `--budget K` is the number of draft tokens verified per round (tree nodes or
chain length, the root not counted), the one knob every drafting method has under
different names. An Options class maps it with a classmethod `budget_knobs(K) -> {field:
value}`; its `BUDGET_SOFT` fields are only defaults (an explicit option wins, e.g. dspark's
schedule), the others may not be given beside --budget. Its `draft_budget()` says what
budget a set of options amounts to (None where it is not fixed), for reports of old
records. A class without budget_knobs (ar, hf) refuses --budget.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any, Literal

from bench.core.errors import BenchError

# A drafter's compute dtype (torch's names).
Dtype = Literal["float32", "bfloat16", "float16"]


def option(default: Any, *, min: float | None = None, max: float | None = None, above: float | None = None,
           choices: tuple | None = None) -> Any:
    """A dataclass field with a range (min/max inclusive, above exclusive) or choices."""
    meta = {k: v for k, v in (("min", min), ("max", max), ("above", above), ("choices", choices)) if v is not None}
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class DraftOptions:
    """Options every drafting method takes (its own Options subclass this).
    oracle_accept: replace each draft token by the AR baseline's own next token with this
    probability per node (given its parent is right), otherwise by a wrong one, keeping the
    method's draft cost and tree shape (bench.core.oracle; greedy only)."""

    oracle_accept: float | None = option(None, min=0.0, max=1.0)
    oracle_seed: int = option(0, min=0)


class _Bad(Exception):
    """A value that does not fit a type; the caller words the message."""


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _members(tp: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(tp)
    return typing.get_args(tp) if origin in (typing.Union, types.UnionType) else (tp,)


def _describe_type(tp: Any, meta: dict) -> str:
    """Short text for one type: `int >= 1`, `exact|typical`, `ints like 2,2,1`, `path`."""
    parts = []
    for member in _members(tp):
        if member is type(None):
            continue
        origin = typing.get_origin(member)
        if origin is Literal:
            parts.append("|".join(str(a) for a in typing.get_args(member)))
        elif origin is tuple:
            inner = typing.get_args(member)[0]
            each = _describe_range(meta)
            parts.append(f"int list like 2,2,1{', each' + each if each else ''}" if inner is int
                         else f"JSON list of int lists{', each' + each if each else ''}")
        elif member is bool:
            parts.append("true|false")
        elif member in (int, float):
            parts.append(f"{member.__name__}{_describe_range(meta)}")
        elif "choices" in meta:
            parts.append("|".join(str(c) for c in meta["choices"]))
        else:
            parts.append(member.__name__)
    if type(None) in _members(tp):
        parts.append("none")
    return " or ".join(parts)


def _describe_range(meta: dict) -> str:
    """` in 1..16`, ` in (0.0, 1.0]`, ` >= 1`, ` > 0.0`, ` <= 9` or ``."""
    low, above, high = meta.get("min"), meta.get("above"), meta.get("max")
    if high is not None and low is not None:
        return f" in {low}..{high}"
    if high is not None and above is not None:
        return f" in ({above}, {high}]"
    if low is not None:
        return f" >= {low}"
    if above is not None:
        return f" > {above}"
    return f" <= {high}" if high is not None else ""


def describe(cls: type) -> str:
    """Every option of `cls` with its type, for error messages: `gamma (int >= 1), ...`."""
    hints = _hints(cls)
    items = [f"{f.name} ({_describe_type(hints[f.name], dict(f.metadata))})" for f in dataclasses.fields(cls)]
    return ", ".join(items) if items else "none"


def _scalar(value: Any, tp: Any, meta: dict) -> Any:
    """`value` as type `tp` (not a union), range-checked; raises _Bad."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        for choice in allowed:
            if value == choice or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                   and str(value) == str(choice)):
                return choice
        raise _Bad
    if origin is tuple:
        inner = typing.get_args(tp)[0]
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    value = json.loads(text)
                except json.JSONDecodeError:
                    raise _Bad from None
            else:
                value = [part for part in text.replace(";", ",").split(",") if part.strip()]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]  # `--option widths=3` decodes to the number 3
        if not isinstance(value, (list, tuple)) or not value:
            raise _Bad
        return tuple(_scalar(v, inner, meta) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
            return value.strip().lower() in ("true", "1")
        raise _Bad
    if tp is int:
        if isinstance(value, bool):
            raise _Bad
        if isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                raise _Bad from None
        if not isinstance(value, int):
            raise _Bad
    elif tp is float:
        if isinstance(value, bool):
            raise _Bad
        if isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                raise _Bad from None
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _Bad
        value = float(value)
    elif tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # the CLI decoded `drafter=123` as a number
        if not isinstance(value, str):
            raise _Bad
        if "choices" in meta and value not in meta["choices"]:
            raise _Bad
        return value
    else:
        raise TypeError(f"option type {tp!r} is not supported")  # a method's declaration is wrong: a bug
    if ("min" in meta and value < meta["min"]) or ("max" in meta and value > meta["max"]) or \
            ("above" in meta and value <= meta["above"]):
        raise _Bad
    return value


def convert(value: Any, tp: Any, meta: dict) -> Any:
    """`value` as the first member of `tp` it fits; raises _Bad."""
    members = _members(tp)
    if type(None) in members and (value is None or (isinstance(value, str) and value.strip().lower() == "none")):
        return None
    for member in members:
        if member is type(None):
            continue
        try:
            return _scalar(value, member, meta)
        except _Bad:
            continue
    raise _Bad


def option_pairs(pairs: tuple[str, ...]) -> dict:
    """`--option key=value` pairs as a dict; a value that reads as JSON is that value."""
    options = {}
    for pair in pairs:
        if "=" not in pair:
            raise BenchError(f"--option takes key=value, got '{pair}'")
        key, value = pair.split("=", 1)
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


# No method verifies more draft tokens a round than this (a target pass over more rows than
# most targets' context); an Options class with a tighter ceiling says so in most_draft_tokens().
MAX_BUDGET = 1024


def parse_options(cls: type, raw: Any, method: str, budget: int | None = None) -> Any:
    """An instance of the frozen dataclass `cls` from `raw` ({key: value}, or already an
    instance), with `--budget` mapped through `cls.budget_knobs`. Bad input: one BenchError line."""
    if isinstance(raw, cls):
        if budget is None:
            return raw
        raw = changed(raw)
    raw = dict(raw or {})
    hints = _hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    valid = f"{method} options: {describe(cls)}"

    def one(key: str, value: Any, source: str) -> Any:
        if key not in known:
            raise BenchError(f"unknown {method} option '{key}' ({valid})")
        try:
            return convert(value, hints[key], dict(known[key].metadata))
        except _Bad:
            expected = _describe_type(hints[key], dict(known[key].metadata))
            raise BenchError(f"{method} option {key} must be {expected}, got {value!r}{source} ({valid})") from None

    values = {key: one(key, value, "") for key, value in raw.items()}
    if budget is not None:
        mapper = getattr(cls, "budget_knobs", None)
        if mapper is None:
            raise BenchError(f"{method} takes no --budget (it verifies no draft tokens)")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise BenchError(f"--budget must be an integer >= 1, got {budget!r}")
        knobs = mapper(budget)
        soft = getattr(cls, "BUDGET_SOFT", ())
        clash = sorted(k for k in knobs if k in raw and k not in soft)
        if clash:
            raise BenchError(f"{method}: --budget {budget} sets {', '.join(clash)}; drop --option {clash[0]}")
        for key, value in knobs.items():
            if key not in raw:
                values[key] = one(key, value, f" (from --budget {budget})")
    try:
        instance = cls(**values)
    except BenchError as exc:  # a check across fields (__post_init__)
        raise BenchError(f"{exc} ({valid})") from None
    if budget is not None:
        most = instance.most_draft_tokens() if hasattr(instance, "most_draft_tokens") else MAX_BUDGET
        if budget > most:
            raise BenchError(f"{method}: --budget {budget} is more draft tokens than it verifies in a round with "
                             f"these options (at most {most})")
    return instance


def changed(options: Any) -> dict[str, Any]:
    """The fields that differ from their defaults, JSON-ready (tuples as lists)."""
    return {f.name: _plain(getattr(options, f.name)) for f in dataclasses.fields(options)
            if f.default is dataclasses.MISSING or getattr(options, f.name) != f.default}


def recorded(cls: type, raw: Any, method: str, budget: int | None = None) -> dict[str, Any]:
    """What a run records as its options: the resolved (typed, budget-mapped) value of every
    option that was given or that the budget set, JSON-ready. Defaults left alone are not
    recorded, so a default run records {} and the same command records what it did before
    typed options (records are only resumed under equal settings)."""
    options = parse_options(cls, raw, method, budget)
    keys = set(changed(raw)) if isinstance(raw, cls) else set(raw or {})
    if budget is not None:
        keys |= set(cls.budget_knobs(budget))
    return {f.name: _plain(getattr(options, f.name)) for f in dataclasses.fields(cls) if f.name in keys}


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value))


def draft_budget(options: Any) -> int | None:
    """The draft tokens per round these options verify (None: not fixed, or no drafts)."""
    method = getattr(options, "draft_budget", None)
    return method() if method is not None else None
