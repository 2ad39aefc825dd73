"""A `guided` spec as a grammar of xgrammar (the `guided` extra): the one place that reads a
spec's kind, so the gateway's check and the engines' compiler build the same grammar.

xgrammar is imported on first use: a gateway or producer without it accepts any well-formed
spec and leaves a grammar that cannot compile to the worker, where it is that job's error.
"""

from __future__ import annotations

import importlib.util
import json
import re
from typing import Any

from wicore.schemas import GuidedSpec

# xgrammar's C++ errors start "[HH:MM:SS] /path/file.cc:LINE: "; the rest says what is wrong.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def available() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


def grammar_of(spec: GuidedSpec) -> Any:
    """The spec as an `xgrammar.Grammar` (tokenizer-independent); ValueError when it cannot be one."""
    import xgrammar as xgr

    try:
        if spec.json_schema is not None:
            return xgr.Grammar.from_json_schema(json.dumps(spec.json_schema), any_whitespace=False)
        if spec.regex is not None:
            return xgr.Grammar.from_regex(spec.regex)
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in spec.choice or ()))
    except RuntimeError as exc:
        raise ValueError(f"{spec.kind}: {cpp_message(exc)}") from None


def cpp_message(exc: BaseException) -> str:
    return _CPP_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)


def grammar_problem(spec: GuidedSpec) -> str | None:
    """Why the spec cannot be a grammar, or None (None too where xgrammar is not installed)."""
    if not available():
        return None
    try:
        grammar_of(spec)
    except ValueError as exc:
        return str(exc)
    return None
