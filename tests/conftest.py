"""Suite-wide settings: one intra-op thread per pytest worker (`make test` runs two workers on two cores).

The header names the PostgreSQL server and the Chromium the suite will use, or why not
(see support.py: the URL defaults to ``postgresql+psycopg://postgres@127.0.0.1:5432/test``).
"""

import torch
from sqlalchemy.engine import make_url
from support import chromium, postgres_probe

torch.set_num_threads(1)


def pytest_report_header() -> list[str]:
    url, reason = postgres_probe()
    shown = make_url(url).render_as_string(hide_password=True) if url else ""
    browser = chromium()
    return [
        f"postgresql: {shown}" if url else f"postgresql: skipped, {reason}",
        f"chromium: {browser}" if browser else "chromium: skipped, not installed",
    ]
