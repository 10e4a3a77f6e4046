"""Test helpers, imported as tests.contract.<module> (pytest: pyproject.toml pythonpath)."""
