"""Property-based requests from the OpenAPI schema (schemathesis): no 5xx, and answers match the schema."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from dashboard_helpers import Federation, LiveServer, database, run_federation
from hypothesis import HealthCheck, given, settings


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    """SQLite only: the API's contract does not depend on the backend (test_api.py runs both)."""
    with database("sqlite", tmp_path_factory.mktemp("schema")) as url:
        yield from run_federation(url)


def test_no_server_errors_and_answers_match_the_schema(dashboard: LiveServer) -> None:
    # schemathesis' pytest plugin (from_fixture) does not run under pytest 9, so drive hypothesis directly
    schema = schemathesis.openapi.from_url(f"{dashboard.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"GET /api/v1/rounds", "POST /api/v1/clients/{client_id}/revoke"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate()

        check()
