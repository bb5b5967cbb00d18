"""Structured log lines, one event a line: logfmt (``ts=… level=… logger=… event=name key=value …``) or JSON lines.

Values often come from clients (names, update ids, refusal details), so every value is cut to
:data:`MAX_VALUE_CHARS`, and in logfmt every value that is not a plain token is quoted and
escaped as a JSON string (newlines, NULs and non-ASCII included): a client cannot forge a line
or flood the log with a megabyte name. ``log_format = "json"`` writes the same fields as one
JSON object a line, for collectors that read JSON.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

__all__ = ["LOG_FORMATS", "MAX_VALUE_CHARS", "Event", "JsonFormatter", "LogfmtFormatter", "configure_logging", "kv"]

MAX_VALUE_CHARS = 200
LOG_FORMATS = ("logfmt", "json")
_PLAIN = re.compile(r"[A-Za-z0-9_.:/@+,\-]+")


def _cut(value: Any) -> Any:
    """Numbers, booleans and None as they are; anything else as text of at most MAX_VALUE_CHARS characters."""
    if value is None or isinstance(value, bool | int) or (isinstance(value, float) and math.isfinite(value)):
        return value
    text = str(value)
    if len(text) > MAX_VALUE_CHARS:
        text = f"{text[:MAX_VALUE_CHARS]}…(+{len(text) - MAX_VALUE_CHARS} chars)"
    return text


def _value(value: Any) -> str:
    text = str(_cut(value))
    return text if _PLAIN.fullmatch(text) else json.dumps(text)


class Event(str):
    """A log message that is an ``event=…`` line and keeps its fields, for :class:`JsonFormatter`."""

    event: str
    fields: dict[str, Any]


def kv(event: str, **fields: Any) -> Event:
    """A structured log line: ``event=name key=value …``; a value that is not a plain token is JSON-quoted."""
    line = Event(" ".join([f"event={_value(event)}", *(f"{k}={_value(v)}" for k, v in fields.items())]))
    line.event, line.fields = event, fields
    return line


class LogfmtFormatter(logging.Formatter):
    """One logfmt line per record: ``ts level logger`` then our ``event=…`` pairs as they are, or any
    other library's free text as ``msg="…"``; a traceback goes in ``exc="…"`` on the same line."""

    def __init__(self) -> None:
        super().__init__(datefmt="%Y-%m-%dT%H:%M:%S")

    def timestamp(self, record: logging.LogRecord) -> str:
        return f"{self.formatTime(record, self.datefmt)}.{int(record.msecs):03d}"

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        body = message if message.startswith("event=") and "\n" not in message else f"msg={json.dumps(message)}"
        line = f"ts={self.timestamp(record)} level={record.levelname} logger={record.name} {body}"
        if record.exc_info:
            line += f" exc={json.dumps(self.formatException(record.exc_info))}"
        return line


class JsonFormatter(LogfmtFormatter):
    """One JSON object per record: ``ts``, ``level``, ``logger``, then ``event`` and its fields, or ``msg``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": self.timestamp(record), "level": record.levelname, "logger": record.name}
        if isinstance(record.msg, Event) and not record.args:
            out["event"] = _cut(record.msg.event)
            for key, value in record.msg.fields.items():
                out.setdefault(key, _cut(value))  # a field named ts or level does not replace the record's
        else:
            out["msg"] = record.getMessage()
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=True, allow_nan=False)


def configure_logging(level: int = logging.INFO, log_format: str = "logfmt") -> None:
    """One line per record for the whole process: logfmt or JSON (the root logger's one handler)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else LogfmtFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
