"""bench: the physical ceiling of single-stream decode (standard library; runs ON THE SPARK with ``run``).

One decode step of a memory-bound model reads every weight it uses once, the KV cache of the context and
the recurrent state of the linear-attention layers, so ``bytes per generated token / memory bandwidth`` is
an upper bound on single-stream decode tok/s without speculation. The bytes come from the served
checkpoint's own safetensors headers (``sparkllm.checkpoint.safetensors_io``, no tensor is read) and its
``config.json``; each tensor is put in one class by its name (the names of Intel's INT4 checkpoint and our
hybrid, see ``tests/fixtures/make_checkpoints.py``):

- ``routed_experts`` (``.mlp.experts.N.``, INT4 qweight + scales + zeros): a token is routed to
  ``num_experts_per_tok`` of ``num_experts``, so top-k / num_experts of their bytes is read;
- ``shared_experts`` (FP8 weight + block scales in the hybrid), ``attention`` (``.self_attn.``),
  ``linear_attention`` (``.linear_attn.``, Gated DeltaNet), ``router`` (``.mlp.gate``,
  ``.mlp.shared_expert_gate``), ``norms`` and anything else of the text model: read whole, every token;
- ``embedding``: one row per token; ``lm_head``: whole, as stored (BF16), or INT8 plus one float32
  scale per row when the server runs our INT8 head (patch 0002, run meta ``lm_head_int8``);
- not read by a baseline decode step: ``mtp.*`` (the MTP module: vLLM 0.19.1's Qwen3.5 model skips
  the ``mtp.`` prefix, vllm/model_executor/models/qwen3_5.py:703; its draft step is reported beside the
  ceiling as ``mtp_draft_step_bytes``: its layer with top-k experts, the shared head and one embedding
  row), the vision tower (``model.visual.*``, text-only requests), and the routed experts not chosen;
- ``kv_cache``: full-attention layers only, ``2 x kv_heads x head_dim x dtype bytes`` per context token
  (cache dtype ``auto`` = the model dtype: vllm/config/cache.py:49, vllm/utils/torch_utils.py:244);
- ``linear_state``: per Gated DeltaNet layer, read and written each token (so counted twice): the conv
  state ``(conv_kernel - 1) x (2 x k_heads x k_dim + v_heads x v_dim)`` in the model dtype and the
  temporal state ``v_heads x v_dim x k_dim`` in ``mamba_ssm_dtype`` of the config when it names one
  (vllm/model_executor/layers/mamba/mamba_utils.py:177-200 shapes, :57-69 dtypes;
  vllm/model_executor/models/config.py:676 takes the config's ``mamba_ssm_dtype``).

A speculative run is compared with ``ceiling x its mean acceptance length``: an upper bound of that shape,
not an exact one, because a verify step of K+1 tokens routes them to more distinct experts than one token,
and the drafter's own reads (``mtp_draft_step_bytes`` for MTP) come on top.

The bandwidth: ``GB10_BANDWIDTH_GBS`` (NVIDIA's DGX Spark specification, 273 GB/s LPDDR5x, nominal) unless
the owner passes a measured figure (``--bandwidth-gbs``). Weights are counted as stored in the checkpoint;
the server may repack them (Marlin for INT4) at about the same size.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from sparkllm.bench.common import UsageError, fmt
from sparkllm.checkpoint.safetensors_io import (
    INDEX_NAME,
    SafetensorsError,
    TensorInfo,
    read_header,
    read_index,
)

# NVIDIA DGX Spark specification (GB10, 128 GB LPDDR5x): 273 GB/s memory bandwidth, nominal
# (https://www.nvidia.com/en-us/products/workstations/dgx-spark/, docs.nvidia.com DGX Spark hardware guide)
GB10_BANDWIDTH_GBS = 273.0
BANDWIDTH_SOURCE = "NVIDIA DGX Spark specification, 273 GB/s nominal"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "bf16": 2, "fp16": 2, "fp32": 4}
READ_CLASSES = ("routed_experts", "shared_experts", "attention", "linear_attention", "router", "norms",
                "embedding", "lm_head", "other", "kv_cache", "linear_state")
FIX = "pass --model-dir the served checkpoint directory (the one holding config.json and *.safetensors)"
_LAYER = re.compile(r"\.layers\.(\d+)\.")


class CeilingInputError(UsageError):
    """The checkpoint directory cannot be read (exit 2; the message names the fix)."""


def load_checkpoint(model_dir: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """(text config, every tensor of every *.safetensors file); CeilingInputError for a bad directory."""
    if not model_dir.is_dir():
        raise CeilingInputError(f"--model-dir {model_dir}: not a directory; {FIX}")
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except OSError as exc:
        raise CeilingInputError(f"{model_dir}/config.json: cannot read it ({exc.strerror}); {FIX}") from None
    except ValueError as exc:
        raise CeilingInputError(f"{model_dir}/config.json: invalid JSON ({exc}); {FIX}") from None
    if not isinstance(cfg, dict):
        raise CeilingInputError(f"{model_dir}/config.json: not a JSON object; {FIX}")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    files = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    if (model_dir / INDEX_NAME).is_file():  # the index names the shards; extra files (MTP) may be beside it
        try:
            files = sorted({*files, *(model_dir / f for f in read_index(model_dir / INDEX_NAME).files)})
        except (SafetensorsError, ValueError) as exc:
            raise CeilingInputError(f"{exc}; fix or re-merge the checkpoint, or {FIX}") from None
    if not files:
        raise CeilingInputError(f"{model_dir}: holds no *.safetensors files; {FIX}")
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        try:
            tensors.update(read_header(f).tensors)
        except (SafetensorsError, OSError) as exc:
            raise CeilingInputError(f"{f}: unreadable safetensors header ({exc}); re-fetch or re-merge the "
                                    f"checkpoint (make deploy --tags model), or {FIX}") from None
    return {**text, "_top": {k: v for k, v in cfg.items() if k != "text_config"}}, list(tensors.values())


def classify(name: str) -> str:
    """The class of a tensor by its name (see the module docstring); ``mtp`` and ``visual`` are not read."""
    if name.startswith("mtp."):
        return "mtp"
    if ".visual." in f".{name}" or name.startswith("visual."):
        return "visual"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared_expert." in name:
        return "shared_experts"
    if ".mlp.gate." in name or ".mlp.shared_expert_gate." in name:
        return "router"
    if ".self_attn." in name:
        return "attention"
    if ".linear_attn." in name:
        return "linear_attention"
    if "embed_tokens." in name:
        return "embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    if name.endswith("norm.weight") or "layernorm" in name:
        return "norms"
    return "other"


def _dtype_bytes(value: Any, default: int = 2) -> int:
    return DTYPE_BYTES.get(str(value).replace("torch.", "").lower(), default) if value else default


def _lm_head_bytes(head: list[TensorInfo], int8: bool) -> int:
    if not int8:
        return sum(t.nbytes for t in head)
    w = [t for t in head if t.name == "lm_head.weight" and len(t.shape) == 2]
    if not w:
        raise CeilingInputError("the INT8 LM head needs lm_head.weight (rows x hidden) in the checkpoint; "
                                "drop --lm-head-int8 or pass the served checkpoint")
    rows, cols = w[0].shape
    return rows * cols + 4 * rows  # INT8 weight + one float32 scale per row (patch 0002)


Classes = dict[str, list[TensorInfo]]


def _kv_per_token(cfg: dict[str, Any], by_cls: Classes, model_bytes: int) -> tuple[int, int]:
    """(full-attention layers, KV bytes per context token over all of them)."""
    layers = {int(m.group(1)) for t in by_cls.get("attention", []) if (m := _LAYER.search(t.name))}
    if not layers:
        return 0, 0
    kv, hd = cfg.get("num_key_value_heads"), cfg.get("head_dim")
    if not (kv and hd):  # from the header: k_norm is (head_dim,), k_proj's output is kv_heads x head_dim
        first = min(layers)
        norm = [t for t in by_cls["attention"] if t.name.endswith(f".{first}.self_attn.k_norm.weight")]
        kproj = [t for t in by_cls["attention"] if f".{first}.self_attn.k_proj." in t.name
                 and t.name.rsplit(".", 1)[1] in ("weight", "scales")]
        if not norm or not kproj:
            raise CeilingInputError("config.json names no num_key_value_heads/head_dim and the header has no "
                                    "self_attn.k_norm/k_proj to read them from; " + FIX)
        hd = norm[0].shape[0]
        width = kproj[0].shape[-1] if kproj[0].name.endswith(".scales") else kproj[0].shape[0]
        kv = width // hd
    return len(layers), len(layers) * 2 * int(kv) * int(hd) * model_bytes


def _linear_state(cfg: dict[str, Any], by_cls: Classes, model_bytes: int) -> tuple[int, int, str]:
    """(Gated DeltaNet layers, state bytes read + written per token, where the dims came from)."""
    lin = by_cls.get("linear_attention", [])
    layers = {int(m.group(1)) for t in lin if (m := _LAYER.search(t.name))}
    if not layers:
        return 0, 0, "-"
    nk, nv = cfg.get("linear_num_key_heads"), cfg.get("linear_num_value_heads")
    dk, dv = cfg.get("linear_key_head_dim"), cfg.get("linear_value_head_dim")
    kern = cfg.get("linear_conv_kernel_dim")
    source = "config.json"
    if not all((nk, nv, dk, dv, kern)):  # from the header: conv1d (conv_dim, 1, kernel), A_log (v_heads,)
        first = min(layers)
        conv = [t for t in lin if t.name.endswith(f".{first}.linear_attn.conv1d.weight")]
        alog = [t for t in lin if t.name.endswith(f".{first}.linear_attn.A_log")]
        norm = [t for t in lin if t.name.endswith(f".{first}.linear_attn.norm.weight")]
        if not (conv and alog and norm):
            raise CeilingInputError("config.json names no linear_* head counts/dims and the header has no "
                                    "linear_attn.conv1d/A_log/norm to read them from; " + FIX)
        conv_dim, kern = conv[0].shape[0], conv[0].shape[-1]
        nv, dv = alog[0].shape[0], norm[0].shape[0]
        dk = dv  # assumption, said in the source field: the config gives both when present
        nk = (conv_dim - nv * dv) // (2 * dk)
        source = "safetensors header (assumes key head dim = value head dim)"
    conv_dim = 2 * int(nk) * int(dk) + int(nv) * int(dv)
    ssm_bytes = _dtype_bytes(cfg.get("mamba_ssm_dtype"), model_bytes)
    per_layer = (int(kern) - 1) * conv_dim * model_bytes + int(nv) * int(dv) * int(dk) * ssm_bytes
    return len(layers), 2 * per_layer * len(layers), source


def breakdown(cfg: dict[str, Any], tensors: Iterable[TensorInfo], *, lm_head_int8: bool = False,
              context: float = 0.0, bandwidth_gbs: float = GB10_BANDWIDTH_GBS,
              bandwidth_source: str = BANDWIDTH_SOURCE) -> dict[str, Any]:
    """Bytes read per generated token by class, and the no-speculation ceiling in tok/s."""
    by_cls: dict[str, list[TensorInfo]] = {}
    for t in tensors:
        by_cls.setdefault(classify(t.name), []).append(t)
    top = cfg.get("_top") or {}
    model_bytes = _dtype_bytes(cfg.get("torch_dtype") or cfg.get("dtype") or top.get("torch_dtype")
                               or top.get("dtype"), 2)
    n_exp, top_k = cfg.get("num_experts"), cfg.get("num_experts_per_tok")
    routed = sum(t.nbytes for t in by_cls.get("routed_experts", []))
    if routed and not n_exp:
        n_exp = len({m.group(1) for t in by_cls["routed_experts"]
                     if (m := re.search(r"\.experts\.(\d+)\.", t.name))})
    if routed and not top_k:
        raise CeilingInputError("config.json names no num_experts_per_tok (top-k), so the routed experts "
                                "read per token are unknown; " + FIX)
    frac = min(1.0, int(top_k) / int(n_exp)) if routed else 0.0
    emb = by_cls.get("embedding", [])
    nbytes: dict[str, float] = {c: float(sum(t.nbytes for t in by_cls.get(c, []))) for c in READ_CLASSES}
    nbytes["routed_experts"] = routed * frac
    nbytes["embedding"] = float(sum(t.nbytes // t.shape[0] for t in emb if t.shape and t.shape[0]))
    nbytes["lm_head"] = float(_lm_head_bytes(by_cls.get("lm_head", []), lm_head_int8))
    full_layers, kv_per_tok = _kv_per_token(cfg, by_cls, model_bytes)
    lin_layers, state, state_src = _linear_state(cfg, by_cls, model_bytes)
    nbytes["kv_cache"] = 0.0
    nbytes["linear_state"] = float(state)
    mtp = by_cls.get("mtp", [])
    mtp_routed = sum(t.nbytes for t in mtp if ".mlp.experts." in t.name)
    mtp_step = (sum(t.nbytes for t in mtp) - mtp_routed + mtp_routed * frac + nbytes["lm_head"]
                + nbytes["embedding"]) if mtp else None
    doc = {"lm_head": "int8" if lm_head_int8 else "as stored", "bytes": nbytes,
           "not_read": {"mtp": sum(t.nbytes for t in mtp),
                        "visual": sum(t.nbytes for t in by_cls.get("visual", [])),
                        "routed_experts_not_chosen": routed * (1 - frac)},
           "experts": {"num_experts": n_exp, "top_k": top_k},
           "full_attention_layers": full_layers, "linear_attention_layers": lin_layers,
           "kv_bytes_per_context_token": kv_per_tok, "linear_state_dims": state_src,
           "model_dtype_bytes": model_bytes, "mtp_draft_step_bytes": mtp_step,
           "bandwidth_gbs": float(bandwidth_gbs), "bandwidth_source": bandwidth_source}
    return with_context(doc, context)


def with_context(doc: dict[str, Any], context: float) -> dict[str, Any]:
    """The breakdown at another context length (KV grows with it; nothing else does)."""
    out = json.loads(json.dumps(doc))
    out["context_tokens"] = float(context)
    out["bytes"]["kv_cache"] = float(out["kv_bytes_per_context_token"]) * float(context)
    total = sum(out["bytes"].values())
    out["bytes_per_token"] = total
    out["ceiling_tok_s"] = out["bandwidth_gbs"] * 1e9 / total if total else None
    return out


def run_context(doc: dict[str, Any]) -> float:
    """Mean context over the decode of the run's answered requests: prompt tokens + half the output."""
    ctx = [(q.get("prompt_tokens") or 0) + (q.get("output_tokens") or 0) / 2
           for q in doc.get("requests") or [] if q.get("ok")]
    return statistics.fmean(ctx) if ctx else 0.0


# ------------------------------------------------------------------ bench.py run / bench.py ceiling


def add_run_options(r: argparse.ArgumentParser) -> None:
    r.add_argument("--model-dir", default=None, metavar="DIR",
                   help="the served checkpoint directory on this host: the run stores the physical ceiling "
                        "(bytes read per token from its safetensors headers / --bandwidth-gbs) "
                        "(default: none, no ceiling)")
    r.add_argument("--bandwidth-gbs", type=float, default=GB10_BANDWIDTH_GBS,
                   help=f"memory bandwidth in GB/s for the ceiling, a measured figure or the nominal one "
                        f"(default: {GB10_BANDWIDTH_GBS:g}, {BANDWIDTH_SOURCE})")


def _bandwidth(a: argparse.Namespace) -> tuple[float, str]:
    if not a.bandwidth_gbs > 0:
        raise UsageError(f"--bandwidth-gbs {a.bandwidth_gbs}: need a positive figure in GB/s, e.g. 273")
    nominal = a.bandwidth_gbs == GB10_BANDWIDTH_GBS
    return a.bandwidth_gbs, BANDWIDTH_SOURCE if nominal else "given with --bandwidth-gbs"


def _truthy(v: Any) -> bool:
    return v is True or str(v).strip().lower() in ("true", "1", "yes")


def for_run(a: argparse.Namespace, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The ceiling at context 0 for ``bench.py run`` (None without --model-dir); the head from meta."""
    if not a.model_dir:
        return None
    bw, src = _bandwidth(a)
    cfg, tensors = load_checkpoint(Path(a.model_dir))
    doc = breakdown(cfg, tensors, lm_head_int8=_truthy(meta.get("lm_head_int8")), bandwidth_gbs=bw,
                    bandwidth_source=src)
    doc["model_dir"] = str(a.model_dir)
    return doc


def attach(doc: dict[str, Any], base: dict[str, Any] | None) -> None:
    """Store the ceiling at the run's measured context in the run document (``doc["ceiling"]``)."""
    if base is not None:
        doc["ceiling"] = with_context(base, run_context(doc))


def breakdown_lines(doc: dict[str, Any]) -> list[str]:
    mb = 1e6
    lines = [f"{'class':<28}{'MB read per token':>18}"]
    lines += [f"{c:<28}{doc['bytes'][c] / mb:>18.3f}" for c in READ_CLASSES if doc["bytes"].get(c)]
    lines += [f"{'total':<28}{doc['bytes_per_token'] / mb:>18.3f}", ""]
    lines += ["not read by a baseline decode step: " + ", ".join(
        f"{k} {v / mb:.3f} MB" for k, v in doc["not_read"].items() if v)]
    if doc.get("mtp_draft_step_bytes"):
        lines.append(f"MTP draft step (its layer, top-k experts, shared head, one embedding row): "
                     f"{doc['mtp_draft_step_bytes'] / mb:.3f} MB")
    lines += [f"experts: top {doc['experts']['top_k']} of {doc['experts']['num_experts']}; LM head "
              f"{doc['lm_head']}; {doc['full_attention_layers']} full-attention layers (KV "
              f"{doc['kv_bytes_per_context_token']} B per context token), {doc['linear_attention_layers']} "
              f"linear-attention layers (state dims from {doc['linear_state_dims']})",
              f"context {doc['context_tokens']:g} tokens; bandwidth {doc['bandwidth_gbs']:g} GB/s "
              f"({doc['bandwidth_source']})",
              f"no-speculation ceiling: {fmt(doc['ceiling_tok_s'])} tok/s (a speculative run: at most this x "
              "its mean acceptance length, an upper bound: a verify step reads more distinct experts)"]
    return lines


def cmd_ceiling(a: argparse.Namespace) -> int:
    if a.context < 0:
        raise UsageError(f"--context {a.context}: need tokens >= 0, e.g. --context 4096")
    bw, src = _bandwidth(a)
    cfg, tensors = load_checkpoint(Path(a.model_dir))
    doc = breakdown(cfg, tensors, lm_head_int8=a.lm_head_int8, context=a.context, bandwidth_gbs=bw,
                    bandwidth_source=src)
    if a.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print("\n".join(breakdown_lines(doc)))
    return 0


def add_parser(parser: Any) -> None:
    """``bench.py ceiling``: the breakdown for a checkpoint directory alone."""
    c = parser("ceiling", "bytes read per generated token and the no-speculation decode ceiling of a "
               "checkpoint directory (stdlib; reads only safetensors headers)")
    c.add_argument("--model-dir", required=True, metavar="DIR", help="checkpoint directory (config.json + "
                   "*.safetensors), e.g. /srv/models/qwen3.5-122b-hybrid")
    c.add_argument("--lm-head-int8", action="store_true",
                   help="count the LM head as INT8 + a float32 scale per row (the server's INT8 head)")
    c.add_argument("--context", type=float, default=0.0, help="context tokens whose KV cache each step reads")
    c.add_argument("--bandwidth-gbs", type=float, default=GB10_BANDWIDTH_GBS,
                   help=f"memory bandwidth in GB/s (default: {GB10_BANDWIDTH_GBS:g}, {BANDWIDTH_SOURCE})")
    c.add_argument("--json", action="store_true", help="print the breakdown as JSON")
    c.set_defaults(func=cmd_ceiling)


# ------------------------------------------------------------------ the report (controller)


def row_ceiling(m: Any) -> dict[str, Any] | None:
    """The ceiling of a report row (mean over its runs that stored one), the bound and the fraction."""
    cs = [r.doc["ceiling"] for r in m.runs if (r.doc.get("ceiling") or {}).get("ceiling_tok_s")]
    ctx = json.loads(m.context) if m.context else {}
    if not cs or ctx.get("request_rate") is not None or (ctx.get("concurrency") or 1) != 1:
        return None  # the ceiling is single-stream: a batch reads the weights once for several tokens
    ceiling = statistics.fmean(c["ceiling_tok_s"] for c in cs)
    spec = bool(m.acc_len) and bool(m.k)
    bound = ceiling * m.acc_len if spec else ceiling
    measured, what = m.decode.get("median"), "decode tok/s median"
    if measured is None:  # non-streamed runs (records profile): whole-request tok/s
        e2e = [((r.doc.get("summary") or {}).get("e2e_tok_s") or {}).get("median") for r in m.runs]
        e2e = [x for x in e2e if x is not None]
        measured, what = (statistics.fmean(e2e), "e2e tok/s median") if e2e else (None, "-")
    return {"ceiling": ceiling, "bound": bound, "spec": spec, "acc_len": m.acc_len if spec else None,
            "measured": measured, "what": what, "fraction": measured / bound if measured and bound else None,
            "gb_per_token": statistics.fmean(c["bytes_per_token"] for c in cs) / 1e9,
            "context": statistics.fmean(c["context_tokens"] for c in cs),
            "bandwidth": cs[0]["bandwidth_gbs"], "lm_head": cs[0]["lm_head"]}


def table_lines(stats: Sequence[Any]) -> list[str]:
    """The report's ceiling section (nothing when no run stored a ceiling)."""
    rows = [(m, c) for m in stats if (c := row_ceiling(m))]
    if not rows:
        return []
    lines = ["", "## Physical ceiling (bytes read per generated token / memory bandwidth; single stream)", "",
             "Bytes from the served checkpoint's safetensors headers (routed experts at top-k, KV at the "
             "run's mean context, linear-attention state read and written). A speculative row is compared "
             "with the ceiling x its mean acceptance length: an upper bound of that shape, not exact (a "
             "verify step of K+1 tokens reads more distinct experts, and the drafter's reads come on top).",
             "", "| row | LM head | GB/token | context | bandwidth GB/s | ceiling tok/s "
             "| x acceptance length | bound tok/s | measured tok/s | fraction of bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m, c in rows:
        lines.append(f"| {m.label} | {c['lm_head']} | {c['gb_per_token']:.3f} | {c['context']:.0f} "
                     f"| {c['bandwidth']:g} | {fmt(c['ceiling'])} | {fmt(c['acc_len'])} | {fmt(c['bound'])} "
                     f"| {fmt(c['measured'])} ({c['what']}) "
                     f"| {'-' if c['fraction'] is None else format(c['fraction'], '.0%')} |")
    return lines


def summary_lines(stats: Sequence[Any]) -> list[str]:
    out = []
    for m in stats:
        c = row_ceiling(m)
        if c and c["fraction"] is not None:
            shape = f"{fmt(c['ceiling'])} x {fmt(c['acc_len'])} mean acceptance length" if c["spec"] else (
                "no speculation")
            out.append(f"ceiling of {m.label}: {fmt(c['measured'])} tok/s ({c['what']}) = "
                       f"{c['fraction']:.0%} of {fmt(c['bound'])} tok/s ({shape}; {c['gb_per_token']:.3f} GB "
                       f"per token at {c['bandwidth']:g} GB/s, context {c['context']:.0f})")
    return out
