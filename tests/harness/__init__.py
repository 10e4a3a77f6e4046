"""Test harness helpers, imported as tests.harness.<module> (pytest: pyproject.toml pythonpath)."""
