"""How the dashboard runs: where it listens, which federation's database it reads, who may act.

The dashboard reads the aggregator's database, so it takes the aggregator's ``database_url``,
``federation_name`` and ``heartbeat_timeout_seconds`` from the same places (the aggregator's
TOML file and ``FEDATOMS_*`` variables); its own keys live in a ``[dashboard]`` table of that
file and in ``FEDATOMS_DASHBOARD_*`` variables, which win over the shared ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from aggregator_service.database_url import DatabaseURL
from aggregator_service.environment import DASHBOARD_SHARE, Unread, unread
from aggregator_service.federation_name import FederationName
from aggregator_service.listen import split_listen
from aggregator_service.toml_settings import TomlSettings

__all__ = ["DEFAULT_DATABASE_TIMEOUT", "DashboardSettings", "unread_environment"]

#: Keys the dashboard shares with the aggregator's settings (top level of its TOML file).
SHARED_KEYS = ("database_url", "federation_name", "heartbeat_timeout_seconds")
#: Seconds a read waits for the database at most, per wait: under Prometheus's 10 s scrape timeout with room to spare.
DEFAULT_DATABASE_TIMEOUT = 3.0


def _env(name: str) -> AliasChoices:
    """The dashboard's own variable first, then the aggregator's, so one environment configures both."""
    return AliasChoices(f"FEDATOMS_DASHBOARD_{name.upper()}", f"FEDATOMS_{name.upper()}")


class DashboardSettings(TomlSettings):
    """Sources, strongest first: keyword arguments (CLI flags), environment, the TOML file, defaults."""

    model_config = SettingsConfigDict(env_prefix="FEDATOMS_DASHBOARD_", extra="forbid", populate_by_name=True)

    listen: str = "127.0.0.1:8080"
    database_url: DatabaseURL = Field(default="sqlite:///fedatoms.db", validation_alias=_env("database_url"))
    federation_name: FederationName = Field(default="default", validation_alias=_env("federation_name"))
    #: A client counts as online while its last call is fresher than this (the aggregator's setting).
    heartbeat_timeout_seconds: float = Field(default=60.0, gt=0.0, validation_alias=_env("heartbeat_timeout_seconds"))
    #: Bearer token for pause, resume and revoke; unset: those endpoints answer 503.
    admin_token: SecretStr | None = None
    #: Bearer token every read needs (the admin token also reads); unset: reads are open.
    read_token: SecretStr | None = None
    #: The longest one wait for the database lasts (connecting, a statement, a lock, a pooled connection): a
    #: database that does not answer fails a read with 503 and ``fedatoms_database_up 0`` instead of hanging it.
    database_timeout_seconds: float = Field(default=DEFAULT_DATABASE_TIMEOUT, gt=0.0, le=300.0)
    #: How often the page polls the REST API.
    poll_seconds: float = Field(default=3.0, gt=0.0, le=3600.0)

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        split_listen(value)
        return value

    @field_validator("admin_token", "read_token")
    @classmethod
    def _check_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("tokens must be at least 16 characters (e.g. `openssl rand -hex 32`)")
        return value

    @property
    def host_port(self) -> tuple[str, int]:
        return split_listen(self.listen)

    @classmethod
    def toml_values(cls, path: Path, document: dict[str, Any]) -> dict[str, Any]:
        """The aggregator's file serves both processes: its shared keys, then the ``[dashboard]`` table."""
        table = document.get("dashboard", {})
        if not isinstance(table, dict):
            raise ValueError(f"{path}: [dashboard] must be a table")
        return {k: document[k] for k in SHARED_KEYS if k in document} | table


def unread_environment() -> list[Unread]:
    """The dashboard's ``FEDATOMS_DASHBOARD_*`` variables that nothing reads (:mod:`aggregator_service.environment`)."""
    return unread(DASHBOARD_SHARE, DashboardSettings)
