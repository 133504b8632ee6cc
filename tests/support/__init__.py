"""Shared test support: fixtures live in tests/conftest.py, helpers here."""
