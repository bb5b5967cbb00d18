"""Structured log lines (logfmt): ``ts=… level=… logger=… event=name key=value …``, one event a line.

Values often come from clients (names, update ids, refusal details), so every value that is not a
plain token is quoted and escaped as a JSON string (newlines, NULs and non-ASCII included) and cut
to :data:`MAX_VALUE_CHARS`: a client cannot forge a line or flood the log with a megabyte name.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

__all__ = ["MAX_VALUE_CHARS", "LogfmtFormatter", "configure_logging", "kv"]

MAX_VALUE_CHARS = 200
_PLAIN = re.compile(r"[A-Za-z0-9_.:/@+,\-]+")


def _value(value: Any) -> str:
    text = str(value)
    if len(text) > MAX_VALUE_CHARS:
        text = f"{text[:MAX_VALUE_CHARS]}…(+{len(text) - MAX_VALUE_CHARS} chars)"
    return text if _PLAIN.fullmatch(text) else json.dumps(text)


def kv(event: str, **fields: Any) -> str:
    """A structured log line: ``event=name key=value …``; a value that is not a plain token is JSON-quoted."""
    return " ".join([f"event={event}", *(f"{k}={_value(v)}" for k, v in fields.items())])


class LogfmtFormatter(logging.Formatter):
    """One logfmt line per record: ``ts level logger`` then our ``event=…`` pairs as they are, or any
    other library's free text as ``msg="…"``; a traceback goes in ``exc="…"`` on the same line."""

    def __init__(self) -> None:
        super().__init__(datefmt="%Y-%m-%dT%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        body = message if message.startswith("event=") and "\n" not in message else f"msg={json.dumps(message)}"
        line = f"ts={self.formatTime(record, self.datefmt)}.{int(record.msecs):03d} level={record.levelname}"
        line += f" logger={record.name} {body}"
        if record.exc_info:
            line += f" exc={json.dumps(self.formatException(record.exc_info))}"
        return line


def configure_logging(level: int = logging.INFO) -> None:
    """Valid logfmt for the whole process (:class:`LogfmtFormatter` on the root logger's one handler)."""
    handler = logging.StreamHandler()
    handler.setFormatter(LogfmtFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
