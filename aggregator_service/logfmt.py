"""Structured log lines (logfmt): ``event=name key=value …``, so logs can be grepped and parsed."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["kv"]


def kv(event: str, **fields: Any) -> str:
    """A structured log line: ``event key=value …``; values with spaces (or empty) are quoted."""

    def fmt(value: Any) -> str:
        text = str(value)
        return json.dumps(text) if (" " in text or not text) else text

    return " ".join([f"event={event}", *(f"{k}={fmt(v)}" for k, v in fields.items())])
