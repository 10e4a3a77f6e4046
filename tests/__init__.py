"""Test helpers, imported as tests.<module> (pytest: pyproject.toml pythonpath)."""
