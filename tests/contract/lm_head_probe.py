"""Drive vLLM's real LM head path on the CPU platform and report what patch 0002 did to it.

Executed in a subprocess by tests/contract/test_lm_head_int8_patch_contract.py, with the Python
of .venv-vllm, once per configuration (the environment decides: SPARKLLM_LM_HEAD_INT8 set or
not, SPARKLLM_LM_HEAD_INT8_KERNEL / TRITON_INTERPRET for the Triton kernel)::

    python lm_head_probe.py [--vllm-parent DIR]

``--vllm-parent`` puts a (patched) copy of the ``vllm`` package first on sys.path, as in
inc_probe.py. Everything below is vLLM's own code: a one-process gloo group, real
VocabParallelEmbedding / ParallelLMHead / LogitsProcessor layers loaded through their
weight_loader, vLLM's model_loader.utils.process_weights_after_loading (where the patch hooks
in), LogitsProcessor.forward and get_top_tokens, and the spec-decode proposer's
_maybe_share_lm_head for an MTP drafter (no has_own_lm_head) and an EAGLE drafter with an
identical own head. Prints one line ``LM_HEAD_PROBE_RESULT <json>``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
import tempfile
import types
import weakref

VOCAB = 1000  # padded by vLLM to 1024: 24 zero rows, as a real padded vocabulary has
HIDDEN = 384
TOKENS = 64


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-parent", default=None)
    a = ap.parse_args()
    if a.vllm_parent:
        sys.path.insert(0, a.vllm_parent)

    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()

    import torch
    import vllm
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import utils as loader_utils

    torch.set_default_dtype(torch.bfloat16)
    report: dict[str, object] = {"vllm_version": vllm.__version__, "loader_utils_file": loader_utils.__file__}
    with set_current_vllm_config(VllmConfig()):
        store = tempfile.mkdtemp(prefix="lm-head-probe-gloo-")
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"file://{store}/store", backend="gloo")
        initialize_model_parallel(1, 1)
        report.update(probe(torch, loader_utils))
    print("LM_HEAD_PROBE_RESULT " + json.dumps(report, sort_keys=True))
    return 0


def probe(torch, loader_utils) -> dict[str, object]:
    from torch import nn
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    gen = torch.Generator().manual_seed(1234)
    w_head = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02).to(torch.bfloat16)
    w_embed = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02).to(torch.bfloat16)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = VocabParallelEmbedding(VOCAB, HIDDEN)

    class CausalLM(nn.Module):
        """The shape of Qwen3_5ForCausalLMBase: model.embed_tokens, lm_head, logits_processor."""

        def __init__(self, tie: bool = False):
            super().__init__()
            self.model = Inner()
            self.lm_head = ParallelLMHead(VOCAB, HIDDEN)
            if tie:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
            self.logits_processor = LogitsProcessor(VOCAB)

        def compute_logits(self, h):
            return self.logits_processor(self.lm_head, h)

    def load(module, name, tensor):
        param = dict(module.named_parameters())[name]
        param.weight_loader(param, tensor)

    def process(model):
        cfg = types.SimpleNamespace(dtype=torch.bfloat16, quantization=None)
        loader_utils.process_weights_after_loading(model, cfg, torch.device("cpu"))

    def param_bytes(module):
        return sum(p.numel() * p.element_size() for p in module.parameters())

    def digest(t):
        return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()

    out: dict[str, object] = {}

    # --- the target: own lm_head, separate embedding -------------------------------------------
    target = CausalLM()
    load(target, "model.embed_tokens.weight", w_embed)
    load(target, "lm_head.weight", w_head)
    head_bytes_before = param_bytes(target.lm_head)
    old_weight = weakref.ref(target.lm_head.weight)
    process(target)
    gc.collect()
    head = target.lm_head
    out["head"] = {
        "dtype": str(head.weight.dtype), "shape": list(head.weight.shape),
        "method": type(head.quant_method).__name__,
        "scale": [str(head.weight_scale.dtype), list(head.weight_scale.shape)]
        if hasattr(head, "weight_scale") else None,
        "bytes_before": head_bytes_before, "bytes_after": param_bytes(head),
        "old_weight_freed": old_weight() is None,
        "params": sorted(n for n, _ in head.named_parameters()),
    }
    embed = target.model.embed_tokens
    out["embedding"] = {
        "dtype": str(embed.weight.dtype), "method": type(embed.quant_method).__name__,
        "unchanged": bool(torch.equal(embed.weight[:VOCAB], w_embed)),
    }
    with torch.inference_mode():
        logits = target.compute_logits(hidden)
        top = target.logits_processor.get_top_tokens(target.lm_head, hidden)
        looked_up = embed(torch.arange(0, VOCAB, 7))
    ref32 = hidden.float() @ w_head.float().t()
    ref16 = torch.nn.functional.linear(hidden, w_head).float()
    err = (logits.float() - ref32).abs()
    out["logits"] = {
        "dtype": str(logits.dtype), "shape": list(logits.shape), "sha256": digest(logits),
        "argmax_agree_fp32": int((logits.float().argmax(-1) == ref32.argmax(-1)).sum()),
        "argmax_agree_bf16": int((logits.float().argmax(-1) == ref16.argmax(-1)).sum()),
        "tokens": TOKENS,
        "max_abs_err": float(err.max()),
        "max_rel_err": float(err.max() / ref32.abs().max()),
        "bf16_max_rel_err": float((ref16 - ref32).abs().max() / ref32.abs().max()),
        "top_tokens_equal_argmax": bool(torch.equal(top.cpu(), logits.float().argmax(-1))),
    }
    out["embedding_lookup_exact"] = bool(torch.equal(looked_up, w_embed[torch.arange(0, VOCAB, 7)]))

    # --- tied embedding: the head's weight is the embedding's (tie_weights) ---------------------
    tied = CausalLM(tie=True)
    load(tied, "model.embed_tokens.weight", w_embed)
    process(tied)
    with torch.inference_mode():
        tied_logits = tied.compute_logits(hidden)
    out["tied"] = {
        "head_dtype": str(tied.lm_head.weight.dtype),
        "embed_dtype": str(tied.model.embed_tokens.weight.dtype),
        "method": type(tied.lm_head.quant_method).__name__,
        "shares_embedding": tied.lm_head.weight is tied.model.embed_tokens.weight,
        "logits_exact": bool(torch.equal(tied_logits, torch.nn.functional.linear(hidden, w_embed))),
    }

    # --- a head the patch must refuse (non-finite weight): stays as loaded, still usable ---------
    bad = CausalLM()
    w_bad = w_head.clone()
    w_bad[5, 7] = float("nan")
    load(bad, "model.embed_tokens.weight", w_embed)
    load(bad, "lm_head.weight", w_bad)
    process(bad)
    out["non_finite"] = {"head_dtype": str(bad.lm_head.weight.dtype),
                         "method": type(bad.lm_head.quant_method).__name__,
                         "weight_unchanged": bool(torch.equal(bad.lm_head.weight[:VOCAB].view(torch.int16),
                                                              w_bad.view(torch.int16)))}

    # --- drafters sharing the target's head through vLLM's own proposer code ------------------
    from vllm.v1.spec_decode.eagle import EagleProposer

    try:  # DFlash (0.20.0 and later): its proposer's own _maybe_share_lm_head
        from vllm.v1.spec_decode.dflash import DFlashProposer
    except ImportError:
        DFlashProposer = None  # noqa: N806
    shares = {"mtp": EagleProposer._maybe_share_lm_head,
              "eagle_identical": EagleProposer._maybe_share_lm_head}
    if DFlashProposer is not None:
        # a DFlash drafter whose checkpoint has no lm_head (has_own_lm_head False): shares
        shares["dflash_no_head"] = DFlashProposer._maybe_share_lm_head
    drafters = {}
    for kind, share in shares.items():
        draft = CausalLM()
        load(draft, "model.embed_tokens.weight", w_embed)
        load(draft, "lm_head.weight", w_head)  # Qwen3.5 MTP loads its own copy of lm_head.weight
        if kind == "eagle_identical":
            draft.has_own_lm_head = True
        elif kind == "dflash_no_head":
            draft.has_own_lm_head = False
        process(draft)
        draft_dtype_before_share = str(draft.lm_head.weight.dtype)
        # the proposer attributes _maybe_share_lm_head reads (0.26.0 also reads
        # vllm_config.speculative_config, for MTP index sharing: none here)
        proposer = types.SimpleNamespace(model=draft, use_local_argmax_reduction=False,
                                         vllm_config=types.SimpleNamespace(speculative_config=None))
        share(proposer, target)
        with torch.inference_mode():
            draft_logits = draft.compute_logits(hidden)
        drafters[kind] = {
            "own_head_dtype_before_share": draft_dtype_before_share,
            "shares_target_head": draft.lm_head is target.lm_head,
            "logits_equal_target": bool(torch.equal(draft_logits, logits)),
        }
    out["drafters"] = drafters
    return out


if __name__ == "__main__":
    sys.exit(main())
