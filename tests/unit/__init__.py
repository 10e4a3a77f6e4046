"""Test helpers, imported as tests.unit.<module> (pytest: pyproject.toml pythonpath)."""
