"""Alembic migrations of the store (``env.py``, ``versions/``); run by :func:`aggregator_service.store.upgrade`."""
