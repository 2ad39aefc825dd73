"""A guided output's grammar: a JSON schema, a regular expression or a list of choices."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from wicore.schemas.base import Strict, Text, shallow

MAX_GUIDED_JSON_BYTES = 65_536  # a schema, regex or choice list larger than this is refused unread
MAX_GUIDED_CHOICES = 1024


def small_json(value: Any) -> Any:
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))
    if size > MAX_GUIDED_JSON_BYTES:
        raise ValueError(f"{size} bytes of JSON; at most {MAX_GUIDED_JSON_BYTES}")
    return value


class GuidedSpec(Strict):
    """Output constrained token by token (engines/guided.py): exactly one of a JSON schema the
    text validates against, a regular expression it matches whole, or a list of strings it is
    one of. Part of the job's identity (its params)."""

    json_schema: Annotated[dict[str, Any], BeforeValidator(shallow), AfterValidator(small_json)] | None = None
    regex: Annotated[Text, Field(min_length=1, max_length=MAX_GUIDED_JSON_BYTES)] | None = None
    choice: Annotated[tuple[Annotated[Text, Field(min_length=1)], ...], AfterValidator(small_json)] | None = Field(
        None, min_length=1, max_length=MAX_GUIDED_CHOICES
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> GuidedSpec:
        given = [name for name in ("json_schema", "regex", "choice") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json_schema, regex and choice (got {', '.join(given) or 'none'})")
        return self

    @property
    def kind(self) -> str:
        return next(name for name in ("json_schema", "regex", "choice") if getattr(self, name) is not None)

    def canonical(self) -> str:
        """Its JSON with sorted keys: equal specs, equal text (the grammar cache's key)."""
        return json.dumps(self.model_dump(mode="json", exclude_none=True), sort_keys=True, separators=(",", ":"))
