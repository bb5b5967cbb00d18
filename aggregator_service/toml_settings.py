"""Settings from keyword arguments, ``FEDATOMS_*`` variables and one TOML file: the aggregator's and the dashboard's.

Both processes read the same file (the dashboard only its shared keys and ``[dashboard]``
table), so they load it one way: the file must exist, a syntax error names the file rather
than surfacing deep inside pydantic, and its values rank below keyword arguments (CLI flags)
and the environment, above the defaults.
"""

from __future__ import annotations

import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Self

from pydantic import ValidationError
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource

__all__ = ["TomlSettings", "explain"]

# pydantic builds the sources inside the constructor, which takes no file argument: from_toml
# hands the file's values over here, per thread and task, for exactly one construction
_TOML_VALUES: ContextVar[dict[str, Any] | None] = ContextVar("_TOML_VALUES", default=None)


class TomlSettings(BaseSettings):
    """Settings loadable with :meth:`from_toml`; a subclass picks its part of the file (:meth:`toml_values`)."""

    @classmethod
    def toml_values(cls, path: Path, document: dict[str, Any]) -> dict[str, Any]:
        """The values this class reads from the parsed file at ``path``: all of it, unless a subclass narrows it."""
        return document

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        values = _TOML_VALUES.get()
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if values is not None:
            # what pydantic's own TOML source does with a file's contents, given them already parsed
            sources.append(InitSettingsSource(settings_cls, init_kwargs=values))
        return tuple(sources)

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> Self:
        """Settings from a TOML file, under ``FEDATOMS_*`` variables and ``overrides`` (``None`` values skipped)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"configuration file {path} does not exist")
        with path.open("rb") as file:
            document = tomllib.load(file)
        token = _TOML_VALUES.set(cls.toml_values(path, document))
        try:
            return cls(**{k: v for k, v in overrides.items() if v is not None})
        finally:
            _TOML_VALUES.reset(token)


def explain(exc: ValidationError) -> str:
    """Each refused key and why, in one line: pydantic's own text spans lines and ends in a link to its docs."""
    parts = []
    for error in exc.errors():
        key = ".".join(str(p) for p in error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        given = error.get("input")
        shown = repr(given)
        if not isinstance(given, dict | list) and len(shown) <= 80 and error["type"] != "value_error":
            message += f" (got {shown})"
        parts.append(f"{key}: {message}" if key else message)
    return "; ".join(parts)
