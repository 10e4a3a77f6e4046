"""Checkpoints: safetensors headers and indexes (`safetensors_io`), input checks (`inputs`), the hybrid
INT4 + FP8 merge plan, MTP index patch, verification and manifests (`hybrid`). Standard library only."""
