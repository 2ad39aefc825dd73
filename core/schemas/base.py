"""The base of every schema and the field types they share: text that is valid Unicode, JSON
that is not nested too deep."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict


class Strict(BaseModel):
    """Unknown keys fail loudly; instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def unicode_text(value: str) -> str:
    """JSON can carry a lone surrogate (an unpaired \\ud800); UTF-8, hashes and tokenizers cannot."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text holds a lone surrogate: not valid Unicode") from None
    return value


MAX_METADATA_DEPTH = 32  # lists and objects inside each other; deeper JSON costs recursion in every reader


def nesting_depth(value: Any, stop_after: int) -> int:
    """How many lists/dicts deep `value` goes ({"a": [1]} is 2), counted up to `stop_after` + 1,
    level by level (no recursion, however deep the value)."""
    depth, level = 0, [value]
    while depth <= stop_after:
        level = [v for v in level if isinstance(v, dict | list | tuple)]
        if not level:
            break
        depth += 1
        level = [child for v in level for child in (v.values() if isinstance(v, dict) else v)]
    return depth


def shallow(value: Any) -> Any:
    if nesting_depth(value, MAX_METADATA_DEPTH) > MAX_METADATA_DEPTH:
        raise ValueError(f"nested deeper than {MAX_METADATA_DEPTH} levels of lists and objects")
    return value


Text = Annotated[str, AfterValidator(unicode_text)]
