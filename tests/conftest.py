"""Suite-wide settings: one intra-op thread per pytest worker (`make test` runs two workers on two cores).

`make test` hands tests to its workers one by one (``--dist loadscope``, each test its own scope here), so
that the slowest files do not keep one worker busy while the other idles; a file that sets up a module- or
session-scoped fixture (a Ray, a federation run once for all its tests) keeps its tests on one worker, so it
sets up once. (pytest-xdist's ``xdist_group`` marks do not group under pytest 9: its scheduler reads a
node id that pytest no longer lets it rewrite.)

The header names the PostgreSQL server and the Chromium the suite will use, or why not
(see support.py: the URL defaults to ``postgresql+psycopg://postgres@127.0.0.1:5432/test``).
"""

import functools
import re
from pathlib import Path

import pytest
import torch
from sqlalchemy.engine import make_url
from support import chromium, postgres_probe

torch.set_num_threads(1)
HERE = Path(__file__).resolve().parent


def pytest_report_header() -> list[str]:
    url, reason = postgres_probe()
    shown = make_url(url).render_as_string(hide_password=True) if url else ""
    browser = chromium()
    return [
        f"postgresql: {shown}" if url else f"postgresql: skipped, {reason}",
        f"chromium: {browser}" if browser else "chromium: skipped, not installed",
    ]


#: The longest real-process runs, tens of seconds each (whole files where a module fixture is the cost). They
#: are the ``slow`` tests: ``make test`` leaves them to ``make test-slow``, and CI runs both.
SLOW = (
    "tests/test_simulate.py::test_learning_on_digits_fedavg_atoms_and_fedlama",
    "tests/test_simulate.py::test_cli_demo_runs_again_in_the_same_output_directory",
    "tests/test_simulate.py::test_a_grpc_simulation_whose_updates_are_refused_ends_at_once_in_one_line[ray]",
    "tests/test_ray_engine.py::",
    "tests/test_simulate_data.py::test_a_batchnorm_model_learns_over_grpc_in_eval_mode",
    "tests/test_simulate_data.py::test_simulate_over_grpc_runs_the_users_own_model",
    "tests/aggregator_service/test_service_any_model.py::test_any_model_federates_over_grpc[torchvision.models:resnet18",
    "tests/aggregator_service/test_service_chaos.py::",
    "tests/aggregator_service/test_service_zoo.py::test_every_zoo_model_closes_a_round[resnet18",
    "tests/aggregator_service/test_service_ownership.py::test_second_aggregator_on_the_same_federation_refuses_to_start",
    "tests/aggregator_service/test_held_average.py::test_resnet18_convs_differ",
    "tests/aggregator_service/test_service_tier_export.py::",
    "tests/aggregator_service/test_composition_rules.py::test_fedlama_relaxes_nothing_in_its_warmup_at_phi_4",
    "tests/client_agent/test_grpc_federation.py::",
    "tests/client_agent/test_client_data.py::test_three_devices_with_their_own_pictures",
    "tests/test_bytes_to_target.py::test_first_seed_runs_the_same_seed_as_a_range_that_contains_it",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    matched: set[str] = set()
    for item in items:
        for prefix in SLOW:
            if item.nodeid.startswith(prefix):
                item.add_marker(pytest.mark.slow)
                matched.add(prefix)
    files = {item.nodeid.split("::")[0] for item in items}
    stale = [p for p in SLOW if p.split("::")[0] in files and p not in matched]
    if stale:  # a renamed test would otherwise move back into make test unnoticed
        raise pytest.UsageError(f"tests/conftest.py SLOW names no collected test: {stale}")


@pytest.hookimpl(optionalhook=True)  # a run without pytest-xdist (-p no:xdist) does not know the hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadscope`` with a test's scope its file where the file shares fixtures (module docstring)."""
    if config.getvalue("dist") != "loadscope":
        return None  # any other mode as pytest-xdist does it
    from xdist.scheduler import LoadScopeScheduling

    class FileWhereShared(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return path if _shares_fixtures(path) else nodeid

    return FileWhereShared(config, log)


SHARED = re.compile(r"""scope\s*=\s*["'](module|package|session)["']""")


@functools.cache
def _shares_fixtures(path: str) -> bool:
    """Whether the test file, or a conftest.py between it and this directory, defines a module-, package- or
    session-scoped fixture (read as text: the controller that schedules does not collect)."""
    file = (HERE.parent / path).resolve()
    places = [file, *(d / "conftest.py" for d in file.parents if d.is_relative_to(HERE) and d != HERE)]
    return any(p.is_file() and SHARED.search(p.read_text()) for p in places)
