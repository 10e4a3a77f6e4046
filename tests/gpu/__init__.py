"""Test helpers, imported as tests.gpu.<module> (pytest: pyproject.toml pythonpath)."""
