"""A conversation: chat turns of text and image parts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from wicore.schemas.base import Strict, Text


class TextPart(Strict):
    type: Literal["text"] = "text"
    text: Text


class ImagePart(Strict):
    type: Literal["image"] = "image"


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: Text | list[TextPart | ImagePart]

    @property
    def image_count(self) -> int:
        if isinstance(self.content, str):
            return 0
        return sum(isinstance(part, ImagePart) for part in self.content)


def check_conversation(messages: Sequence[ChatMessage]) -> None:
    """A conversation the model can answer: at least one turn, the last a user's, images only in
    user turns."""
    if not messages:
        raise ValueError("messages: give at least one turn")
    if messages[-1].role != "user":
        raise ValueError(f"messages: the last turn must be the user's, not the {messages[-1].role}'s")
    for index, message in enumerate(messages):
        if message.role != "user" and message.image_count:
            raise ValueError(f"messages.{index}: image parts go in user turns, not {message.role} turns")
