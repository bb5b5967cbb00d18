"""Alembic revisions, one per schema change, named ``NNNN_<slug>.py`` with revision id ``NNNN_<slug>``."""
