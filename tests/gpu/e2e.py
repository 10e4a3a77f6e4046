#!/usr/bin/env python3
"""Real GPU, end to end: our merged checkpoint, our patch and our serve arguments on a real vLLM.

    python3 tests/gpu/e2e.py --out DIR [--work DIR] [--budget SECONDS] [--only LABELS]  (make gpu-e2e)

On a host with a CUDA GPU where ``import vllm`` works (vLLM 0.20.0 here, the DFlash variant's base;
0.19.1 needs torch 2.10 and cannot run beside torch 2.11), it

1. builds the tiny Qwen3.5-MoE pair (tests/gpu/tiny_pair.py: Intel's INT4 AutoRound layout,
   Qwen's FP8 layout) and runs OUR pipeline on it: scripts/hybrid_merge.py, the MTP index patch
   (scripts/mtp_index_patch.py), scripts/verify_checkpoint.py --expect-mtp --expect-hybrid; it also
   makes the published recipe's variant: the same hybrid with mtp.* left out of the index;
2. copies the installed vllm package and applies patches/vllm-<version>/ to the copy (the
   installed package is never modified): servers run "stock" or "patched" by PYTHONPATH;
3. starts, at once, one server per case with the argv ``spark_serve_argv`` renders for the
   method (overrides: model path, served name, context length, memory share, port; the flags this
   host needs go through the same knobs owners use, ``vllm_attention_backend`` and
   ``vllm_serve_extra_args``, see HOST_SETTINGS):
     int4-ref        patched, baseline, Intel's INT4 checkpoint (shared experts BF16)
     hybrid-base     patched, baseline, our hybrid (shared experts FP8)
     hybrid-mtp      patched, mtp
     hybrid-ngram    patched, ngram
     stock-hybrid    stock vLLM, baseline, our hybrid
     recipe-mtp      patched, mtp, the hybrid without the MTP index patch
     hybrid-mtp-int8 patched, mtp, INT8 LM head (SPARKLLM_LM_HEAD_INT8=1, what vllm_lm_head_int8 sets)
     hybrid-eagle3   patched, eagle3 with the tiny drafter of tiny_eagle3.py (K=3; only with --only)
   ``--only hybrid-base,hybrid-eagle3`` starts just those (the checks that need an absent server are
   left out; default: the seven above without hybrid-eagle3);
4. asks each the same completions at temperature 0 (with logprobs), runs ``scripts/bench.py run``
   against hybrid-base, hybrid-mtp, hybrid-ngram (and hybrid-eagle3), writes the report, and checks:
     - patched: our log line counts the 12 shared-expert FP8 layers, no weight_scale_inv is
       skipped, and greedy tokens equal the INT4 checkpoint's with top-1 logprobs within LOGPROB_TOL;
     - stock on the same hybrid skips the scales and fails that same check;
     - greedy text follows the tiny model's successor machine (the model works, not just loads);
     - mtp: /metrics counts drafts, acceptance >= MTP_MIN_ACCEPTANCE, tokens equal baseline's;
     - the recipe variant: what vLLM does without the MTP index patch is recorded;
     - INT8 LM head (patch 0002): its log line names the Triton kernel for the target (and the MTP
       drafter's copy, which vLLM then replaces by the target's head), no fallback warning; greedy
       tokens of hybrid-mtp-int8 equal hybrid-mtp's (agreement count and max logprob difference
       reported) and MTP acceptance over the probe requests stays >= MTP_MIN_ACCEPTANCE;
     - the runner's acceptance figures equal the deltas of the counters it recorded, and its last
       snapshot equals an independent scrape taken after it finished;
     - eagle3: tokens equal baseline's, position 0 accepted as the drafter is built, and the runner's
       drafts, draft tokens, accepted tokens and per-position acceptance equal the deltas of our own
       /metrics readings (a watcher scrapes every ~20 ms while the runner runs: the runner's first
       snapshot must be one of its readings, its last the final one).
Prints one JSON summary line (``E2E SUMMARY {...}``), writes DIR/summary.json; exit 0 when every
check passed, 1 when one failed (each failure named), 2 usage.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "filter_plugins")]  # tests.gpu.* and the filters, run as a script
from spark_methods import SETTING_DEFAULTS, spark_serve_argv  # noqa: E402

from tests.gpu import tiny_pair  # noqa: E402

# The flags this host needs, through the owners' knobs (validated like every other setting; the
# contract suite parses them with vLLM 0.20.0's own parser):
#  - FLASH_ATTN: FlashInfer's attention kernels are compiled at first use (no prebuilt cubins
#    here), so the catalogue's FLASHINFER for mtp is replaced on this host;
#  - --language-model-only: the tiny vision tower is not served;
#  - Triton GDN prefill and MoE kernels: FlashInfer's would be JIT-built;
#  - --enforce-eager: no CUDA graph capture (start time);
#  - --kv-cache-memory-bytes: a fixed KV cache, so six servers starting at once on one GPU do not
#    size their caches from each other's memory use.
HOST_SETTINGS = {
    "vllm_attention_backend": "FLASH_ATTN",
    "vllm_serve_extra_args": ["--language-model-only", "--gdn-prefill-backend", "triton",
                              "--moe-backend", "triton", "--enforce-eager",
                              "--kv-cache-memory-bytes", str(1 << 30)],
}
# Environment the host needs: vLLM 0.20.0's first choices for block-FP8 GEMMs are FlashInfer's and
# DeepGEMM's JIT-built kernels (nvcc at the first request; seen failing here), so they are
# disabled and vLLM falls back to its compiled CUTLASS block-FP8 kernel.
HOST_ENV = {"VLLM_DISABLED_KERNELS": ",".join(["FlashInferFp8DeepGEMMDynamicBlockScaledKernel",
                                               "DeepGemmFp8BlockScaledMMKernel"])}
TEST_OVERRIDES = {"vllm_served_model_name": "tiny", "vllm_max_model_len": 2048,
                  "vllm_gpu_memory_utilization": 0.08}
LOGPROB_TOL = 0.05
MTP_MIN_ACCEPTANCE = 0.9
PROMPTS = ["The quick brown fox", "def main():", "Spark owners serve Qwen", "x = [1, 2, 3]",
           "Hello, world", "JSON: {\"a\": 7}", "Why is the sky blue?", "tok/s at 4k context"]
PROBE_TOKENS = 48
FP8_LINE = re.compile(r"found (\d+) FP8 layers")
SKIP_LINE = re.compile(r"weight_scale_inv not found in params_dict")
# patch 0002's load line (patches/src/sparkllm_lm_head_int8.py) and its fallback/skip lines
LM_HEAD_LINE = re.compile(r"sparkllm: lm_head INT8 \(per-row\), (\d+)x(\d+) in (\w+) \((\S+)\), "
                          r"kernel (\w+), weight max abs err (\S+) \(max \|w\| (\S+)\), "
                          r"check logits max abs err (\S+)")
LM_HEAD_FALLBACK = re.compile(r"sparkllm: lm_head INT8 unavailable[^\n]*")
LM_HEAD_SKIP = re.compile(r"sparkllm: lm_head INT8 skipped[^\n]*")
# The environment vllm_lm_head_int8: true gives the server container (templates/sparkllm-vllm.env.j2).
LM_HEAD_INT8_ENV = {"SPARKLLM_LM_HEAD_INT8": "1"}
# INT8 logits move top-1 logprobs a little (per-row error <= max|w_row|/254 per weight).
LM_HEAD_LOGPROB_TOL = 0.1


def logger(prog: str):
    """A log function whose lines carry prog's name and the time, so a console of several scripts reads."""
    def log_line(msg: str) -> None:
        print(f"[{prog} {time.strftime('%H:%M:%S')}] {msg}", flush=True)
    return log_line


log = logger("e2e")


TIMED_OUT = 124  # run's return code for a command stopped at its timeout (as timeout(1) says it)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """cmd's result with its output as text; a command that outruns ``timeout`` is killed and comes back
    as a failed result (TIMED_OUT, what it printed so far and a last line naming the limit), so the
    caller records a failed check and the run's summary is still written."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)
    except subprocess.TimeoutExpired as e:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        return subprocess.CompletedProcess(
            cmd, TIMED_OUT, text(e.stdout),
            text(e.stderr) + f"\nstopped after its {e.timeout:.0f} s timeout: "
            + " ".join(Path(c).name for c in cmd[:3]) + "\n")


# ------------------------------------------------------------------ pipeline
def host_versions(prog: str) -> dict | None:
    """vLLM, torch, the GPU and vLLM's site-packages of this host, from a child Python (so a missing CUDA
    fails there, not here); None, after one line on stderr naming what is missing, when there is none."""
    ver = run([sys.executable, "-c", "import json, os, torch, vllm; print(json.dumps({"
               "'vllm': vllm.__version__, 'torch': torch.__version__, "
               "'gpu': torch.cuda.get_device_name(0), "
               "'site': os.path.dirname(os.path.dirname(vllm.__file__))}))"])
    if ver.returncode:
        print(f"{prog}: vLLM or a GPU is not available here: {ver.stderr.strip().splitlines()[-1:]}",
              file=sys.stderr)
        return None
    return json.loads(ver.stdout.strip().splitlines()[-1])


class Record:
    """One GPU-host run's record: summary.json with its checks, the host's versions and the elapsed time.
    ``check`` logs a PASS/FAIL line (its detail as JSON, cut at 600 characters) and keeps the failures."""

    def __init__(self, out: Path, work: Path, log_fn=None, **sections: dict) -> None:
        self.t0 = time.monotonic()
        self.out, self.log = out, log_fn or log
        out.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        self.failures: list[str] = []
        self.summary: dict = {"host": {}, **sections, "checks": {}}

    def check(self, name: str, ok: bool, detail: object) -> None:
        self.summary["checks"][name] = {"ok": bool(ok), "detail": detail}
        self.log(f"{'PASS' if ok else 'FAIL'} {name}: {json.dumps(detail, default=str)[:600]}")
        if not ok:
            self.failures.append(name)

    def save(self) -> None:
        self.summary["seconds"] = round(time.monotonic() - self.t0, 1)
        self.summary["failed"] = self.failures
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1, default=str))

    def patched(self, work: Path, host: dict) -> tuple[Path, str]:
        """vLLM with our patch series (patched_vllm) under work; (its directory, the PYTHONPATH that puts
        it before the host's site-packages). The applied patches go in the summary."""
        patched, applied = patched_vllm(work, Path(host["site"]), host["vllm"])
        self.summary["patches_applied"] = applied
        return patched, os.pathsep.join([str(patched), host["site"], os.environ.get("PYTHONPATH", "")])

    @contextlib.contextmanager
    def closing(self, servers: dict):
        """However the block ends: an exception is a failed check (and raised again, the figures so far
        kept), then the servers are stopped and summary.json written."""
        try:
            yield
        except Exception as e:
            self.check("run finished without an exception", False, f"{type(e).__name__}: {e}"[:600])
            raise
        finally:
            for s in servers.values():
                s.stop()
            self.save()

    def host(self, prog: str) -> dict | None:
        """host_versions, with vLLM, torch, the GPU and today's date in the summary; None: not here."""
        host = host_versions(prog)
        if host is not None:
            self.summary["host"] = {k: host[k] for k in ("vllm", "torch", "gpu")}
            self.summary["host"]["date"] = time.strftime("%Y-%m-%d")
        return host


def build_models(work: Path, **shape) -> dict:
    py = sys.executable
    pair = work / "pair"
    info = tiny_pair.generate(pair, **shape)  # shape: tiny_pair.generate's hidden=, rows= (the head's)
    hybrid = work / "hybrid"
    out = {"pair": {k: info[k] for k in ("int4_files", "fp8_files")}}
    if hybrid.exists() and not (hybrid / ".sparkllm_merge.json").exists():
        raise SystemExit(f"{hybrid} exists and is not a merge output; choose another --work")
    merge = run([py, str(ROOT / "scripts/hybrid_merge.py"), "--int4", info["int4"], "--fp8", info["fp8"],
                 "--out", str(hybrid), "--json"])
    if merge.returncode:
        raise SystemExit(f"hybrid_merge.py failed: {merge.stderr or merge.stdout}")
    out["merge"] = json.loads(merge.stdout)["summary"]
    patch = run([py, str(ROOT / "scripts/mtp_index_patch.py"), "--source", info["int4"],
                 "--target", str(hybrid), "--json"])
    if patch.returncode:
        raise SystemExit(f"mtp_index_patch.py failed: {patch.stderr or patch.stdout}")
    out["mtp_index_patch"] = json.loads(patch.stdout)
    verify = run([py, str(ROOT / "scripts/verify_checkpoint.py"), str(hybrid), "--expect-mtp",
                  "--expect-hybrid", "--expect-tool-tokens", "--json"])
    out["verify"] = json.loads(verify.stdout)
    if verify.returncode:
        raise SystemExit(f"verify_checkpoint.py refused our hybrid: {verify.stdout}")
    # The published recipe's result: the same files, mtp.* missing from the index.
    recipe = work / "hybrid-no-mtp-index"
    shutil.rmtree(recipe, ignore_errors=True)
    shutil.copytree(hybrid, recipe)
    index = json.loads((recipe / "model.safetensors.index.json").read_text())
    dropped = [n for n in index["weight_map"] if n.startswith("mtp.")]
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if not n.startswith("mtp.")}
    (recipe / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    out["recipe_dropped_from_index"] = len(dropped)
    out["dirs"] = {"int4": info["int4"], "hybrid": str(hybrid), "recipe": str(recipe)}
    return out


def patched_vllm(work: Path, stock_site: Path, version: str) -> tuple[Path, list[str]]:
    """A copy of the installed vllm package with the modules of patches/src installed (patches/src/modules)
    and our series applied by ``patch -p1`` (the installed package is never modified)."""
    series_dir = ROOT / "patches" / f"vllm-{version}"
    names = [ln.strip() for ln in (series_dir / "series").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    if not shutil.which("patch"):
        raise SystemExit("e2e.py: GNU patch is not installed: it applies our vLLM patches")
    dest = work / "vllm-patched"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    shutil.copytree(stock_site / "vllm", dest / "vllm", symlinks=True)
    # the modules the patches call, carried once in patches/src (what apply_patches.sh installs first)
    src = ROOT / "patches" / "src"
    for line in (src / "modules").read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if fields:
            (dest / fields[1]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / fields[0], dest / fields[1])
    for name in names:
        diff = (series_dir / name).read_text()
        r = run(["patch", "-p1", "-d", str(dest), "--forward", "--batch"], input=diff)
        if r.returncode:
            raise SystemExit(f"patch {name} does not apply to vLLM {version}: {r.stdout}{r.stderr}")
    return dest, names


# ------------------------------------------------------------------ servers
class Server:
    def __init__(self, label: str, method: str, model: str, port: int, pythonpath: str, logs: Path,
                 extra_env: dict[str, str] | None = None, extra_settings: dict | None = None):
        self.label, self.method, self.model, self.port = label, method, model, port
        settings = dict(SETTING_DEFAULTS, spec_method=method, vllm_model_path=model, vllm_port=port,
                        **TEST_OVERRIDES, **HOST_SETTINGS)
        settings.update(extra_settings or {})
        self.argv = spark_serve_argv(settings, load_catalogue())
        self.env = dict(os.environ, **HOST_ENV, PYTHONPATH=pythonpath, PYTHONUNBUFFERED="1",
                        VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "INFO"), **(extra_env or {}))
        self.log_path = logs / f"vllm-{label}.log"
        self.proc: subprocess.Popen | None = None
        self.healthy_after: float | None = None
        self.exit_code: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.t0 = time.monotonic()
        with open(self.log_path, "w") as f:
            f.write("argv: vllm serve " + " ".join(self.argv) + "\n")
            f.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *self.argv],
                stdout=f, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)

    def poll(self) -> str:
        """'up', 'starting' or 'dead'."""
        if self.healthy_after is not None:
            return "up"
        if self.proc.poll() is not None:
            self.exit_code = self.proc.returncode
            return "dead"
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                if r.status == 200:
                    self.healthy_after = time.monotonic() - self.t0
                    return "up"
        except (urllib.error.URLError, OSError):
            pass
        return "starting"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@functools.cache
def load_catalogue() -> dict:
    import yaml

    return yaml.safe_load((ROOT / "group_vars/all/methods.yml").read_text())["spark_method_catalogue"]


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def probe(server: Server) -> list[dict]:
    """Greedy completions of PROMPTS with top-1 logprobs."""
    out = []
    for p in PROMPTS:
        r = post(server.url + "/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": PROBE_TOKENS,
                                                  "temperature": 0, "logprobs": 1})
        c = r["choices"][0]
        out.append({"prompt": p, "text": c["text"], "tokens": c["logprobs"]["tokens"],
                    "logprobs": c["logprobs"]["token_logprobs"]})
    return out


def scrape(server: Server) -> dict:
    """Our own reading of the spec-decode counters (independent of bench.py's parser): name ->
    summed value, per-position counters by position."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict = {"per_pos": {}}
    for line in text.splitlines():
        m = re.match(r"^(vllm:(?:spec_decode_\w+|generation_tokens_total))(\{[^}]*\})?\s+(\S+)$", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        pos = re.search(r'position="(\d+)"', labels)
        if name.endswith("per_pos_total") and pos:
            out["per_pos"][pos.group(1)] = out["per_pos"].get(pos.group(1), 0.0) + value
        else:
            out[name] = out.get(name, 0.0) + value
    return out


ALL_CASES = ("int4-ref", "hybrid-base", "hybrid-mtp", "hybrid-ngram", "stock-hybrid", "recipe-mtp",
             "hybrid-mtp-int8", "hybrid-eagle3")
DEFAULT_CASES = ALL_CASES[:-1]


# ------------------------------------------------------------------ checks
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def runner_matches_counters(spec: dict, counters: dict, before: dict, after: dict) -> dict:
    """The runner's figures against (a) the deltas of the raw counters it recorded for its measured
    phase and (b) our own scrapes just before and after the runner ran: its first snapshot cannot
    precede ours, its last must equal ours (nothing runs after its measured phase)."""
    b, e = counters.get("before") or {}, counters.get("after") or {}
    drafts = (e.get(DRAFTS) or 0) - (b.get(DRAFTS) or 0)
    accepted = (e.get(ACCEPTED) or 0) - (b.get(ACCEPTED) or 0)
    draft_tokens = (e.get(DRAFT_TOKENS) or 0) - (b.get(DRAFT_TOKENS) or 0)
    pos_b, pos_e = b.get(PER_POS) or {}, e.get(PER_POS) or {}
    per_pos = [(pos_e[p] - pos_b.get(p, 0.0)) / drafts for p in sorted(pos_e, key=int)] if drafts else None
    runner_pp = spec.get("per_position") or []
    figures = (spec.get("num_drafts") == drafts and spec.get("num_accepted_tokens") == accepted
               and spec.get("num_draft_tokens") == draft_tokens and per_pos is not None
               and len(per_pos) == len(runner_pp)
               and all(abs(x - y) < 1e-12 for x, y in zip(per_pos, runner_pp, strict=True)))
    last = (after.get(DRAFTS) == e.get(DRAFTS) and after.get(ACCEPTED) == e.get(ACCEPTED)
            and after.get("per_pos") == pos_e
            and (DRAFT_TOKENS not in after or after.get(DRAFT_TOKENS) == e.get(DRAFT_TOKENS)))
    first = before.get(DRAFTS, 0.0) <= (b.get(DRAFTS) or 0)
    return {"ok": bool(figures and last and first and drafts), "figures_equal_deltas": figures,
            "last_snapshot_equals_our_scrape": last, "first_snapshot_not_before_ours": first,
            "runner": {"drafts": spec.get("num_drafts"), "accepted": spec.get("num_accepted_tokens"),
                       "per_position": runner_pp},
            "counters": {"drafts": drafts, "accepted": accepted, "per_position": per_pos}}


def _reading(scr: dict) -> dict:
    """The spec-decode counters of one of our scrapes, in the runner's raw_counters shape."""
    return {DRAFTS: scr.get(DRAFTS), DRAFT_TOKENS: scr.get(DRAFT_TOKENS), ACCEPTED: scr.get(ACCEPTED),
            PER_POS: dict(scr.get("per_pos") or {})}


class CounterWatch:
    """Scrapes a server's /metrics every ``interval`` seconds in a thread and keeps each distinct
    reading of the spec-decode counters, so the runner's snapshots can be looked up among readings
    it did not take."""

    def __init__(self, server: Server, interval: float = 0.01):
        import threading

        self.server, self.interval = server, interval
        self.readings: list[dict] = []
        self.scrapes = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                r = _reading(scrape(self.server))
                self.scrapes += 1
                if not self.readings or self.readings[-1] != r:
                    self.readings.append(r)
            except (OSError, ValueError):
                self.errors += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> CounterWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def runner_vs_own_readings(spec: dict, counters: dict, readings: list[dict], final: dict) -> dict:
    """The runner's drafts, draft tokens, accepted tokens and per-position acceptance against the
    deltas of OUR readings: its first snapshot must be one of our readings (taken while it ran), its
    last must equal our final scrape; the deltas between those two readings of ours must give the
    runner's figures."""
    norm = lambda c: {k: (c or {}).get(k) for k in (DRAFTS, DRAFT_TOKENS, ACCEPTED)} | {  # noqa: E731
        PER_POS: dict((c or {}).get(PER_POS) or {})}
    b_run, e_run = norm(counters.get("before")), norm(counters.get("after"))
    fin = _reading(final)
    first = next((i for i, r in enumerate(readings) if r == b_run), None)
    out: dict = {"readings": len(readings), "runner_first_snapshot_seen_at": first,
                 "runner_last_snapshot_equals_our_final_scrape": e_run == fin}
    if first is None:
        out.update(ok=False, why="the runner's first snapshot is not among our readings")
        return out
    b = readings[first]
    d = {k: (fin[k] or 0) - (b[k] or 0) for k in (DRAFTS, DRAFT_TOKENS, ACCEPTED)}
    n = d[DRAFTS]
    pos = sorted(fin[PER_POS], key=int)
    acc_pos = {p: fin[PER_POS][p] - b[PER_POS].get(p, 0.0) for p in pos}
    per_pos = [acc_pos[p] / n for p in pos] if n else None
    rp = spec.get("per_position") or []
    checks = {"drafts": spec.get("num_drafts") == d[DRAFTS],
              "draft_tokens": spec.get("num_draft_tokens") == d[DRAFT_TOKENS],
              "accepted_tokens": spec.get("num_accepted_tokens") == d[ACCEPTED],
              "per_position": per_pos is not None and len(per_pos) == len(rp)
              and all(abs(x - y) < 1e-12 for x, y in zip(per_pos, rp, strict=True))}
    out.update(ok=bool(n) and all(checks.values()) and out["runner_last_snapshot_equals_our_final_scrape"],
               equal=checks,
               runner={"drafts": spec.get("num_drafts"), "draft_tokens": spec.get("num_draft_tokens"),
                       "accepted_tokens": spec.get("num_accepted_tokens"), "per_position": rp,
                       "acceptance_rate": spec.get("acceptance_rate"),
                       "mean_acceptance_length": spec.get("mean_acceptance_length")},
               our_deltas={"drafts": d[DRAFTS], "draft_tokens": d[DRAFT_TOKENS],
                           "accepted_tokens": d[ACCEPTED],
                           "accepted_per_position": acc_pos, "per_position": per_pos,
                           "acceptance_rate": d[ACCEPTED] / d[DRAFT_TOKENS] if d[DRAFT_TOKENS] else None})
    return out


def compare(ref: list[dict], got: list[dict]) -> dict:
    same = sum(1 for a, b in zip(ref, got, strict=True) if a["tokens"] == b["tokens"])
    diffs = [abs(x - y) for a, b in zip(ref, got, strict=True) if a["tokens"] == b["tokens"]
             for x, y in zip(a["logprobs"], b["logprobs"], strict=True) if x is not None and y is not None]
    return {"same_tokens": same, "prompts": len(ref), "max_abs_logprob_diff": max(diffs) if diffs else None,
            "distinct_texts": len({g["text"] for g in got})}


def follows_successors(results: list[dict]) -> int:
    n = 0
    for r in results:
        expect = tiny_pair.greedy_continuation(r["prompt"][-1], len(r["text"]))
        n += r["text"] == expect
    return n


def lm_head_lines(text: str) -> list[dict]:
    keys = ("rows", "cols", "model", "name", "kernel", "weight_max_abs_err", "max_abs_w", "check_logit_err")
    return [dict(zip(keys, (int(m[0]), int(m[1]), *m[2:]), strict=True)) for m in LM_HEAD_LINE.findall(text)]


def acceptance(counters: dict) -> float | None:
    drafted = counters.get(DRAFT_TOKENS) or 0
    return round(counters.get(ACCEPTED, 0.0) / drafted, 4) if drafted else None


def check_lm_head_int8(check, summary: dict, text: dict, results: dict, counters: dict) -> None:
    """Patch 0002 on a real GPU: hybrid-mtp-int8 against hybrid-mtp (same checkpoint, same method)."""
    lines = lm_head_lines(text["hybrid-mtp-int8"])
    fallbacks = LM_HEAD_FALLBACK.findall(text["hybrid-mtp-int8"])
    vocab = tiny_pair.vocab_size()
    target = [ln for ln in lines if "MTP" not in ln["model"]]
    # a drafter's own copy is replaced by the target's head after loading (vLLM shares it), so only
    # the target's fallback fails the check; every line is reported
    target_fallbacks = [f for f in fallbacks if "MTP (" not in f]
    ok = bool(target) and not target_fallbacks and all(ln["kernel"] == "triton" and ln["rows"] >= vocab
                                                       for ln in lines)
    check("int8 lm_head: load line for the target, Triton kernel, no fallback", ok,
          {"lines": lines, "fallbacks": fallbacks, "skips": LM_HEAD_SKIP.findall(text["hybrid-mtp-int8"])})
    check("int8 lm_head: off unless asked (hybrid-mtp has no such line)",
          "sparkllm: lm_head" not in text["hybrid-mtp"], None)
    fig: dict = {"lines": lines}
    if "hybrid-mtp" in results and "hybrid-mtp-int8" in results:
        cmp = compare(results["hybrid-mtp"], results["hybrid-mtp-int8"])
        fig["vs_hybrid_mtp"] = cmp
        diff = cmp["max_abs_logprob_diff"]
        check("int8 lm_head: greedy tokens equal hybrid-mtp's (BF16 head)",
              cmp["same_tokens"] >= len(PROMPTS) - 1 and diff is not None and diff <= LM_HEAD_LOGPROB_TOL,
              {"same_tokens": f"{cmp['same_tokens']}/{cmp['prompts']}", "max_abs_logprob_diff": diff,
               "tolerance": LM_HEAD_LOGPROB_TOL})
        rates = {k: acceptance(counters.get(k, {})) for k in ("hybrid-mtp", "hybrid-mtp-int8")}
        fig["probe_acceptance"] = rates
        rate = rates["hybrid-mtp-int8"]
        check("int8 lm_head: MTP acceptance over the probe requests stays high",
              rate is not None and rate >= MTP_MIN_ACCEPTANCE, rates)
    summary["figures"]["lm_head_int8"] = fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="e2e.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="results: logs, run JSONs, report, summary.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/sparkllm-gpu-e2e"),
                    help="scratch directory for models and the patched vLLM (default /tmp/sparkllm-gpu-e2e)")
    ap.add_argument("--budget", type=float, default=540, help="seconds for the whole run (default 540)")
    ap.add_argument("--start-timeout", type=float, default=360,
                    help="seconds to wait for the servers to come up (default 360)")
    ap.add_argument("--bench-max-tokens", type=int, default=128, help="bench.py --max-tokens (default 128)")
    ap.add_argument("--only", default=",".join(DEFAULT_CASES),
                    help=f"comma list of the servers to start, from {', '.join(ALL_CASES)} "
                         "(default: all but hybrid-eagle3)")
    a = ap.parse_args(argv)
    only = [c for c in a.only.split(",") if c]
    if not only or any(c not in ALL_CASES for c in only):
        print(f"e2e.py: --only takes labels from {', '.join(ALL_CASES)}", file=sys.stderr)
        return 2
    rec = Record(a.out, a.work, figures={})
    t_start, summary, failures, check = rec.t0, rec.summary, rec.failures, rec.check
    host = rec.host("e2e.py")
    if host is None:
        return 2
    log(f"host: {summary['host']}")

    models = build_models(a.work)
    summary["pipeline"] = {k: models[k] for k in ("merge", "verify", "recipe_dropped_from_index")}
    log(f"pipeline: merge {models['merge']}, verify ok={models['verify']['ok']}")
    patched, patched_pp = rec.patched(a.work, host)
    stock_pp = os.pathsep.join([host["site"], os.environ.get("PYTHONPATH", "")])
    d = models["dirs"]
    extra_settings: dict[str, dict] = {}
    if "hybrid-eagle3" in only:
        from tests.gpu import tiny_eagle3

        drafter = tiny_eagle3.generate(a.work / "eagle3", tokenizer_from=Path(d["hybrid"]))
        extra_settings["hybrid-eagle3"] = {"spec_eagle3_drafter": drafter["path"]}
        summary["eagle3_drafter"] = drafter
    cases = [("int4-ref", "baseline", d["int4"], patched_pp, None),
             ("hybrid-base", "baseline", d["hybrid"], patched_pp, None),
             ("hybrid-mtp", "mtp", d["hybrid"], patched_pp, None),
             ("hybrid-ngram", "ngram", d["hybrid"], patched_pp, None),
             ("stock-hybrid", "baseline", d["hybrid"], stock_pp, None),
             ("recipe-mtp", "mtp", d["recipe"], patched_pp, None),
             ("hybrid-mtp-int8", "mtp", d["hybrid"], patched_pp, LM_HEAD_INT8_ENV),
             ("hybrid-eagle3", "eagle3", d["hybrid"], patched_pp, None)]
    assert [c[0] for c in cases] == list(ALL_CASES)
    servers = {label: Server(label, method, model, 8101 + i, pp, a.out, env, extra_settings.get(label))
               for i, (label, method, model, pp, env) in enumerate(cases) if label in only}
    summary["only"] = only
    for s in servers.values():
        s.start()
    log("started " + ", ".join(f"{s.label}:{s.port}" for s in servers.values()))
    deadline = time.monotonic() + min(a.start_timeout, a.budget - (time.monotonic() - t_start) - 120)
    while time.monotonic() < deadline:
        states = {k: s.poll() for k, s in servers.items()}
        if all(v != "starting" for v in states.values()):
            break
        time.sleep(2)
    states = {k: s.poll() for k, s in servers.items()}
    summary["servers"] = {k: {"state": states[k], "ready_s": None if s.healthy_after is None
                              else round(s.healthy_after, 1), "exit_code": s.exit_code,
                              "argv": s.argv} for k, s in servers.items()}
    log(f"server states: { {k: (v, servers[k].healthy_after) for k, v in states.items()} }")
    with rec.closing(servers):
        results, probe_errors = {}, {}
        for k, s in servers.items():
            if states[k] != "up":
                continue
            try:
                results[k] = probe(s)
                (a.out / f"probe-{k}.json").write_text(json.dumps(results[k], indent=1))
            except (OSError, ValueError, KeyError) as e:
                probe_errors[k] = f"{type(e).__name__}: {e}"
                log(f"{k}: completions failed: {probe_errors[k]}")
        summary["probe_errors"] = probe_errors
        up = [k for k in results]
        probe_counters = {k: scrape(servers[k]) for k in ("hybrid-mtp", "hybrid-mtp-int8", "hybrid-eagle3")
                          if k in results}
        for k in ("int4-ref", "hybrid-base", "hybrid-mtp", "hybrid-ngram", "stock-hybrid", "hybrid-mtp-int8",
                  "hybrid-eagle3"):
            if k not in servers:
                continue
            brief = {x: summary["servers"][k][x] for x in ("state", "ready_s", "exit_code")}
            check(f"{k} serves", k in up, brief)
        text = {k: s.log_text() for k, s in servers.items()}
        if "hybrid-base" in text:
            fp8 = [int(x) for x in FP8_LINE.findall(text["hybrid-base"])]
            check("patched: our log line counts the 12 shared-expert FP8 layers",
                  fp8 == [12] * len(fp8) and fp8,
                  {"counts": fp8, "expected": models["merge"]["taken_from_fp8"]})
        for k in ("hybrid-base", "hybrid-mtp", "hybrid-ngram", "hybrid-eagle3"):
            if k in text:
                check(f"{k}: no FP8 scale skipped", not SKIP_LINE.search(text[k]),
                      len(SKIP_LINE.findall(text[k])))
        for k in ("int4-ref", "hybrid-base"):
            if k in text:
                check(f"{k}: routed experts on the INT4 (Marlin WNA16) MoE path",
                      bool(re.search(r"Using 'MARLIN' WNA16 MoE backend", text[k])),
                      re.findall(r"Using '?\w+'? WNA16 MoE backend", text[k])[:2])
        if "hybrid-base" in text:
            fp8_kernel = re.findall(r"Selected (\w+) for Fp8LinearMethod", text["hybrid-base"])
            check("patched: shared experts on vLLM's FP8 linear method", bool(fp8_kernel), fp8_kernel[:2])
        if "stock-hybrid" in text:
            stock_skips = len(SKIP_LINE.findall(text["stock-hybrid"]))
            check("stock: skips the FP8 scales (the bug)", stock_skips > 0, stock_skips)
        summary["kernel_lines"] = {k: sorted({m.strip()[:160] for m in re.findall(
            r"[^\n]*(?:Marlin|Fp8|FP8|MoE backend|Using \w+ backend)[^\n]*", text[k])})[:12]
            for k in ("int4-ref", "hybrid-base", "stock-hybrid") if k in text}
        if "int4-ref" in results and "hybrid-base" in results:
            cmp = compare(results["int4-ref"], results["hybrid-base"])
            summary["figures"]["hybrid_vs_int4"] = cmp
            tol_ok = cmp["max_abs_logprob_diff"] is not None and cmp["max_abs_logprob_diff"] <= LOGPROB_TOL
            same = cmp["same_tokens"] == cmp["prompts"]
            check("patched hybrid tracks the INT4 checkpoint", same and tol_ok, cmp)
            succ = follows_successors(results["int4-ref"])
            check("INT4 checkpoint answers as the tiny model was built to", succ >= len(PROMPTS) - 1,
                  f"{succ}/{len(PROMPTS)} prompts follow the successor map")
            check("different prompts, different answers", cmp["distinct_texts"] == len(PROMPTS),
                  cmp["distinct_texts"])
        if "int4-ref" in results and "stock-hybrid" in results:
            cmp = compare(results["int4-ref"], results["stock-hybrid"])
            summary["figures"]["stock_vs_int4"] = cmp
            check("stock vLLM fails the same check on our hybrid", cmp["same_tokens"] < cmp["prompts"] // 2
                  or (cmp["max_abs_logprob_diff"] or 0) > LOGPROB_TOL, cmp)
        for k in ("hybrid-mtp", "hybrid-ngram", "hybrid-eagle3"):
            if "hybrid-base" in results and k in results:
                cmp = compare(results["hybrid-base"], results[k])
                summary["figures"][f"{k}_vs_baseline"] = cmp
                check(f"{k}: same greedy tokens as baseline (lossless)",
                      cmp["same_tokens"] >= len(PROMPTS) - 1, f"{cmp['same_tokens']}/{cmp['prompts']}")
        if "hybrid-mtp" in text and "hybrid-mtp-int8" in text:
            check_lm_head_int8(check, summary, text, results, probe_counters)
        if "hybrid-eagle3" in results:
            m = probe_counters["hybrid-eagle3"]
            drafts = m.get(DRAFTS) or 0
            p0 = (m.get("per_pos") or {}).get("0", 0.0) / drafts if drafts else None
            fig = {"drafts": m.get(DRAFTS), "draft_tokens": m.get(DRAFT_TOKENS), "accepted": m.get(ACCEPTED),
                   "accepted_per_pos": m.get("per_pos"), "acceptance": acceptance(m),
                   "position_0": None if p0 is None else round(p0, 4)}
            summary["figures"]["eagle3_probe"] = fig
            check("eagle3: drafts counted, position 0 accepted as the drafter is built (>= 0.8)",
                  bool(drafts) and p0 is not None and p0 >= 0.8, fig)
        if "hybrid-base" in results:
            tool = {"type": "function", "function": {
                "name": "get_weather", "description": "weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
            try:
                r = post(servers["hybrid-base"].url + "/v1/chat/completions", {
                    "model": "tiny", "messages": [{"role": "user", "content": "Weather in Seoul?"}],
                    "tools": [tool], "tool_choice": "auto", "max_tokens": 16, "temperature": 0})
                tool_ok, detail = "choices" in r, {"finish_reason": r["choices"][0].get("finish_reason")}
            except urllib.error.HTTPError as e:
                tool_ok, detail = False, f"HTTP {e.code}: {e.read()[:300]!r}"
            except (OSError, ValueError, KeyError) as e:
                tool_ok, detail = False, f"{type(e).__name__}: {e}"
            check("tool calling: a request with tools is served (was HTTP 400)", tool_ok, detail)
        recipe = servers.get("recipe-mtp")
        summary["recipe_without_mtp_index_patch"] = None if recipe is None else {
            "state": states["recipe-mtp"], "exit_code": recipe.exit_code,
            "error": [ln[:300] for ln in text["recipe-mtp"].splitlines()
                      if re.search(r"Error|error:|missing|not found", ln)][-4:],
            "mtp_lines": [ln[:200] for ln in text["recipe-mtp"].splitlines()
                          if re.search(r"(?i)mtp|draft|speculat", ln)][:6]}
        if "recipe-mtp" in results:
            m = scrape(recipe)
            summary["recipe_without_mtp_index_patch"].update(
                drafts=m.get(DRAFTS), draft_tokens=m.get(DRAFT_TOKENS), accepted=m.get(ACCEPTED),
                same_tokens_as_baseline=compare(results["hybrid-base"], results["recipe-mtp"])["same_tokens"]
                if "hybrid-base" in results else None)
        if recipe is not None:
            check("recipe variant (no MTP index patch) outcome recorded", True,
                  summary["recipe_without_mtp_index_patch"])

        # bench.py run against the three hybrid servers, one after the other
        runs = a.out / "runs"
        # hybrid-eagle3 first: started only with --only, where its runner check is the point
        for k in ("hybrid-eagle3", "hybrid-base", "hybrid-mtp", "hybrid-ngram"):
            if k not in results:
                continue
            s = servers[k]
            left = a.budget - (time.monotonic() - t_start)
            if left < 45:
                check(f"{k}: bench run", False, f"no time left ({left:.0f} s)")
                continue
            before = scrape(s)
            label = {"hybrid-base": "baseline", "hybrid-mtp": "mtp", "hybrid-ngram": "ngram",
                     "hybrid-eagle3": "eagle3"}[k]
            meta = {"speculative_config": json.loads(s.argv[s.argv.index("--speculative-config") + 1])
                    if "--speculative-config" in s.argv else None, "serve_argv": s.argv, "gpu": host["gpu"]}
            with CounterWatch(s) as watch:
                r = run([sys.executable, str(ROOT / "scripts/bench.py"), "run", "--base-url", s.url,
                         "--model", "tiny", "--label", label, "--out", str(runs), "--warmup", "1",
                         "--max-tokens", str(a.bench_max_tokens), "--category", "chat_qa,code,json,math",
                         "--quiet", "--meta-json", json.dumps(meta)], timeout=max(30, left - 15))
            after = scrape(s)
            docs = sorted(runs.glob(f"*-{label}-*.json")) if runs.exists() else []
            if r.returncode or not docs:
                check(f"{k}: bench run", False, (r.stdout + r.stderr)[-800:])
                continue
            doc = json.loads(docs[-1].read_text())
            sp, counters = doc["spec"], doc.get("spec_counters", {})
            med = lambda x: round(x["median"], 4) if isinstance(x, dict) and x.get("median") else None  # noqa: E731
            fig = {"valid": doc["valid"], "problems": doc["problems"],
                   "requests": doc["summary"].get("requests"),
                   "decode_tok_s_median": med(doc["summary"].get("decode_tok_s")),
                   "ttft_s_median": med(doc["summary"].get("ttft_s")),
                   "acceptance_rate": sp.get("acceptance_rate"), "per_position": sp.get("per_position"),
                   "mean_acceptance_length": sp.get("mean_acceptance_length"),
                   "num_drafts": sp.get("num_drafts")}
            summary["figures"][f"bench-{label}"] = fig
            check(f"{k}: bench run valid", doc["valid"], fig)
            if label == "baseline":
                continue
            agree = runner_matches_counters(sp, counters, before, after)
            check(f"{k}: runner's acceptance = /metrics deltas of its measured phase", agree["ok"], agree)
            own = runner_vs_own_readings(sp, counters, watch.readings, after)
            own.update(scrapes=watch.scrapes, scrape_errors=watch.errors)
            summary["figures"][f"bench-{label}"]["runner_vs_own_readings"] = own
            check(f"{k}: runner's drafts, draft tokens, accepted, per position = deltas of our own readings",
                  own["ok"], own)
            drafts = agree["counters"]["drafts"]
            if label == "eagle3":
                pp0 = (sp.get("per_position") or [None])[0]
                check("eagle3 bench: position 0 accepted as the drafter is built (>= 0.8)",
                      bool(drafts) and pp0 is not None and pp0 >= 0.8,
                      {"drafts": drafts, "per_position": sp.get("per_position"),
                       "acceptance_rate": sp.get("acceptance_rate")})
            if label == "mtp":
                rate = sp.get("acceptance_rate")
                check("mtp: drafts counted and accepted", bool(drafts) and rate is not None
                      and rate >= MTP_MIN_ACCEPTANCE, {"drafts": drafts, "acceptance_rate": rate,
                                                       "per_position": sp.get("per_position")})
        if runs.exists():
            rep = run([sys.executable, str(ROOT / "scripts/bench.py"), "report", str(runs), "--out",
                       str(a.out / "report"), "--no-charts"])
            check("report written", rep.returncode == 0 and (a.out / "report" / "report.md").exists(),
                  (rep.stdout + rep.stderr)[-400:])
    print("E2E SUMMARY " + json.dumps({k: summary[k] for k in ("host", "figures", "failed", "seconds")}),
          flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
