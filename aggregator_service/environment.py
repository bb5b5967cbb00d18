"""``FEDATOMS_*`` variables that nothing reads: each is named, with the variable it most likely meant.

Settings read their variables by name and pass over the rest, as pydantic-settings does, so a misspelt
``FEDATOMS_DATABSE_URL`` left the aggregator on its SQLite default, and a misspelt read token left the
dashboard's reads open, with nothing said. Several processes share the prefix, each with its share of
it: the dashboard reads ``FEDATOMS_DASHBOARD_*``, the tests ``FEDATOMS_TEST_*``, the aggregator and its
store commands the rest. A process names the variables in its share that neither it nor anything in
:data:`READ_ELSEWHERE` reads. Warned, not refused: one environment file serves several processes and
releases, and a variable a newer release reads must not stop an older one from starting.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterable, Mapping

from pydantic import AliasChoices
from pydantic_settings import BaseSettings

__all__ = [
    "AGGREGATOR_SHARE",
    "DASHBOARD_SHARE",
    "READ_ELSEWHERE",
    "Unread",
    "describe",
    "settings_variables",
    "unread",
]

PREFIX = "FEDATOMS_"
#: the dashboard's own variables (it also reads the aggregator's shared ones, which its share leaves out)
DASHBOARD_SHARE = "FEDATOMS_DASHBOARD_"
TESTS_SHARE = "FEDATOMS_TEST_"
#: the aggregator's share: every FEDATOMS_ variable not in another process's
AGGREGATOR_SHARE = PREFIX

#: Variables read outside the settings classes, so that no process warns about them.
READ_ELSEWHERE = frozenset(
    {
        # deploy/compose.yaml interpolates these on the host; they never reach a container
        "FEDATOMS_TAG",
        "FEDATOMS_IMAGE_PREFIX",
        "FEDATOMS_ROUNDS",
        "FEDATOMS_TLS_DIR",
        "FEDATOMS_AGGREGATOR_PORT",
        "FEDATOMS_DASHBOARD_PORT",
        "FEDATOMS_AGGREGATOR_PUBLISH_ADDRESS",
        "FEDATOMS_DASHBOARD_PUBLISH_ADDRESS",
        # the images' gRPC health probe (deploy/images/grpc_health.py)
        "FEDATOMS_HEALTH_ADDR",
        "FEDATOMS_HEALTH_TLS_NAME",
        # the client agent's systemd unit (deploy/systemd/fedatoms-client.service)
        "FEDATOMS_SERVER",
        "FEDATOMS_CLIENT_DATA",
        # where the dataset loaders look (fedcore.data)
        "FEDATOMS_DATA_DIR",
        # make test-deploy's switch (tests/deploy)
        "FEDATOMS_DEPLOY_TESTS",
    }
)


@dataclasses.dataclass(frozen=True)
class Unread:
    """A variable nothing reads, and the closest one that something does (None: nothing close)."""

    name: str
    did_you_mean: str | None


def settings_variables(settings: type[BaseSettings]) -> tuple[frozenset[str], tuple[str, ...]]:
    """The variables a settings class reads, and the prefixes under which it reads nested keys.

    A field is read as its prefix plus its upper-cased name, or as each name its validation alias
    lists. With a nested delimiter, ``PREFIX + FIELD + delimiter`` starts a nested key, which the
    class's own validation checks; the keys of a nested dataclass or model are listed too, so that a
    near miss (``FEDATOMS_FEDERATION_ROUNDS``) is pointed to its key.
    """
    config = settings.model_config
    prefix = str(config.get("env_prefix") or "")
    delimiter = config.get("env_nested_delimiter")
    names: set[str] = set()
    nested: list[str] = []
    for field_name, field in settings.model_fields.items():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            names.update(str(choice) for choice in alias.choices if isinstance(choice, str))
        elif isinstance(alias, str):
            names.add(alias)
        else:
            names.add(f"{prefix}{field_name}".upper())
        if delimiter:
            start = f"{prefix}{field_name}{delimiter}".upper()
            nested.append(start)
            names.update(f"{start}{key}".upper() for key in _keys(field.annotation))
    return frozenset(names), tuple(nested)


def _keys(annotation: object) -> list[str]:
    """The field names of a dataclass or pydantic model type; none for any other type."""
    if dataclasses.is_dataclass(annotation):
        return [f.name for f in dataclasses.fields(annotation)]
    fields = getattr(annotation, "model_fields", None)
    return list(fields) if isinstance(fields, dict) else []


def unread(
    share: str,
    settings: type[BaseSettings],
    environ: Mapping[str, str] | None = None,
    *,
    other_shares: Iterable[str] = (),
) -> list[Unread]:
    """The variables in ``share`` (a name prefix, minus ``other_shares``) that ``settings`` does not read
    and :data:`READ_ELSEWHERE` does not name, sorted, each with the closest name that is read."""
    environ = os.environ if environ is None else environ
    read, nested = settings_variables(settings)
    known = sorted(read | READ_ELSEWHERE)
    others = (*other_shares, TESTS_SHARE)
    out = []
    for name in sorted(environ):
        if not name.startswith(share) or name.startswith(tuple(o for o in others if o != share)):
            continue
        if name in read or name in READ_ELSEWHERE or name.startswith(nested):
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        out.append(Unread(name, close[0] if close else None))
    return out


def describe(found: Unread) -> str:
    """One line for a log or a terminal."""
    hint = f"; did you mean {found.did_you_mean}?" if found.did_you_mean else ""
    return f"{found.name} is set, but no fedatoms process reads it{hint}"
