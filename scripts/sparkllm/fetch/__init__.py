"""Fetching a checkpoint (`scripts/fetch_checkpoint.py`): common, remote (HTTP ranges), mirror, hub
(huggingface_hub, imported lazily). Standard library otherwise; runs on the Spark."""
