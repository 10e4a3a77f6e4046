"""The image lock's inputs (controller only, not run on the Spark): the pinned vLLM sdists (`sources`) and
pip's dry-run resolution of what each variant's image installs (`resolve`; needs PyYAML)."""
