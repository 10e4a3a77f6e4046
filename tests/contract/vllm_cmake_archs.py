"""What vLLM's own CMake architecture selection gives each kernel family, run for real in script mode.

From a release's CMakeLists.txt we keep, in their order, the control flow (if/elseif/else/endif) and the
statements that choose architectures (set(CUDA_SUPPORTED_ARCHS ...), clear_cuda_arches,
extract_unique_cuda_archs_ascending, cuda_archs_loose_intersection, cuda_archs_sm90plus), and run them
with `cmake -P` after including the release's cmake/utils.cmake: the numbers are the release's, never
copied by hand. CMAKE_CUDA_FLAGS holds the -gencode flags torch's own select_compute_arch.cmake makes for
TORCH_CUDA_ARCH_LIST (from the torch of .venv-vllm), CMAKE_CUDA_COMPILER_VERSION is the base image's nvcc.
Each selection prints `VLLMARCH|<line>|<var>|<src list>|<result>`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

# nvcc of nvcr.io/nvidia/cuda:13.0.1-devel-ubuntu24.04 (vllm_build_base_image)
NVCC_VERSION = "13.0.88"
KEEP = {"if", "elseif", "else", "endif", "clear_cuda_arches", "extract_unique_cuda_archs_ascending",
        "cuda_archs_loose_intersection", "cuda_archs_sm90plus"}

# Kernel families that serve our model -> (CMake variable, a substring its source list must contain or
# None). Several blocks reuse SCALED_MM_ARCHS; the SM120-family one is the one GB10 runs.
FAMILIES = {
    "Marlin dense INT4, fp16 out (sm80_kernel_*_float16)": ("MARLIN_ARCHS", None),
    "Marlin dense INT4, bf16 out (sm80_kernel_*_bfloat16)": ("MARLIN_BF16_ARCHS", None),
    "Marlin dense repack/dispatch (marlin.cu, *_marlin_repack.cu)": ("MARLIN_OTHER_ARCHS", None),
    "Marlin MoE INT4 (marlin_moe_wna16 kernels)": ("MARLIN_MOE_ARCHS", None),
    "Marlin MoE dispatch (marlin_moe_wna16/ops.cu)": ("MARLIN_MOE_OTHER_ARCHS", None),
    "FP8 scaled_mm / block GEMM, CUTLASS SM120 (scaled_mm_c3x_sm120)": ("SCALED_MM_ARCHS", "12."),
    "CUTLASS MoE data (grouped GEMM set-up)": ("CUTLASS_MOE_DATA_ARCHS", None),
    "MoE routing kernels (topk, align, sum) and attention/cache kernels of _C; FA2 target":
        ("CUDA_ARCHS", None),
}


@dataclass(frozen=True)
class Selection:
    line: int
    var: str
    src: str
    result: tuple[str, ...]


def _statements(text: str):
    """(line, command name, full text) of each top-level CMake command, comments dropped."""
    i, line, n = 0, 1, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c.isalpha() or c == "_":
            m = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\s*\(").match(text, i)
            if not m:
                j = text.find("\n", i)
                i = n if j < 0 else j
                continue
            name = m.group(0).split("(")[0].strip().lower()
            j, depth, quoted, start_line = m.end(), 1, False, line
            while j < n and depth:
                ch = text[j]
                if ch == "\n":
                    line += 1
                if quoted:
                    if ch == "\\":
                        j += 1
                    elif ch == '"':
                        quoted = False
                elif ch == '"':
                    quoted = True
                elif ch == "#":
                    k = text.find("\n", j)
                    j = (n if k < 0 else k) - 1
                elif ch == "(":
                    depth += 1
                elif ch == ")":
                    depth -= 1
                j += 1
            yield start_line, name, text[i:j]
            i = j
        else:
            i += 1


def selection_script(cmakelists: str, utils: Path, cuda_flags: str, nvcc_version: str = NVCC_VERSION) -> str:
    """The cmake -P script of a CMakeLists.txt's architecture selection (see the module doc)."""
    out = [
        f'include("{utils.as_posix()}")',
        f'set(CMAKE_CUDA_COMPILER_VERSION "{nvcc_version}")',
        'set(VLLM_TARGET_DEVICE "cuda")', 'set(VLLM_GPU_LANG "CUDA")', "set(CUDA_FOUND TRUE)",
        # operands of conditions that do not choose architectures (torch/ROCm version warnings)
        'set(Torch_VERSION "0")', 'set(TORCH_SUPPORTED_VERSION_CUDA "0")',
        'set(TORCH_SUPPORTED_VERSION_ROCM "0")',
        'set(ROCM_VERSION_DEV_MAJOR "0")',
        f'set(CMAKE_CUDA_FLAGS "{cuda_flags}")',
    ]
    for line, name, stmt in _statements(cmakelists):
        if name == "set" and re.match(r"set\s*\(\s*CUDA_SUPPORTED_ARCHS\b", stmt):
            out += [stmt, f'message("VLLMARCH|{line}|CUDA_SUPPORTED_ARCHS||${{CUDA_SUPPORTED_ARCHS}}")']
        elif name in KEEP:
            out.append(stmt)
            m = re.match(r'\w+\s*\(\s*(\w+)\s+("[^"]*")?', stmt)
            if name in ("cuda_archs_loose_intersection", "cuda_archs_sm90plus",
                        "extract_unique_cuda_archs_ascending"):
                var = m.group(1)
                src = (m.group(2) or '""').strip('"') if name != "extract_unique_cuda_archs_ascending" else ""
                if name == "cuda_archs_loose_intersection" and not m.group(2):
                    rest = stmt.split(None, 1)[1].rsplit('"${CUDA_ARCHS}"', 1)[0]
                    src = re.sub(r"\s+", "", rest.split(var, 1)[1])
                out.append(f'message("VLLMARCH|{line}|{var}|{src.replace(chr(36), "")}|${{{var}}}")')
    return "\n".join(out) + "\n"


def torch_gencode_flags(cmake: str, torch_cmake_dir: Path, arch_list: str, cuda_version: str = "13.0") -> str:
    """The -gencode flags torch's select_compute_arch.cmake makes for TORCH_CUDA_ARCH_LIST=arch_list."""
    (sel,) = torch_cmake_dir.rglob("select_compute_arch.cmake")
    script = (f'set(CUDA_VERSION {cuda_version})\ninclude("{sel.as_posix()}")\n'
              f'cuda_select_nvcc_arch_flags(_f "{arch_list}")\nstring(REPLACE ";" " " _f "${{_f}}")\n'
              'message("FLAGS=${_f}")\n')
    return _run(cmake, script).split("FLAGS=", 1)[1].strip()


def _run(cmake: str, script: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.cmake"
        path.write_text(script)
        res = subprocess.run([cmake, "-P", str(path)], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"cmake -P failed ({res.returncode}): {res.stderr.strip()[-800:]}")
    return res.stderr + res.stdout


def run_selection(cmake: str, source: Path, cuda_flags: str) -> list[Selection]:
    script = selection_script((source / "CMakeLists.txt").read_text(), source / "cmake" / "utils.cmake",
                              cuda_flags)
    sels = []
    for row in _run(cmake, script).splitlines():
        if row.startswith("VLLMARCH|"):
            _, line, var, src, result = row.split("|", 4)
            sels.append(Selection(int(line), var, src, tuple(x for x in result.split(";") if x)))
    return sels


def gb10_code(archs: tuple[str, ...], device: str = "12.1") -> str:
    """What a device of compute capability ``device`` runs from a CMake arch list (vLLM's notation)."""
    major, minor = (int(x) for x in device.split("."))
    sass, ptx = [], []
    for a in archs:
        base = a.replace("+PTX", "")
        m = re.fullmatch(r"(\d+)\.(\d+)([af]?)", base)
        amaj, amin, suffix = int(m.group(1)), int(m.group(2)), m.group(3)
        runs = amaj == major and (amin == minor if suffix == "a" else amin <= minor)
        if runs:
            sass.append(f"sm_{amaj}{amin}{suffix}")
        if a.endswith("+PTX") and (amaj, amin) <= (major, minor):
            ptx.append(f"compute_{amaj}{amin}")
    if sass:
        return "SASS " + ", ".join(sass)
    if ptx:
        return "PTX only (" + ", ".join(ptx) + ", JIT at load)"
    return "not built"


def family_table(sels: list[Selection]) -> dict[str, dict[str, str]]:
    """{family: {"archs": CMake result, "gb10": what GB10 runs, "line": CMakeLists.txt line}}."""
    table = {}
    for family, (var, must) in FAMILIES.items():
        hits = [s for s in sels if s.var == var and (must is None or must in s.src)]
        if var == "CUDA_ARCHS":
            hits = [s for s in hits if s.src]  # the supported-list intersection, not the raw target
        if not hits:
            table[family] = {"archs": "", "gb10": "not in this release", "line": ""}
            continue
        last = hits[-1]
        table[family] = {"archs": ";".join(last.result), "gb10": gb10_code(last.result),
                         "line": str(last.line)}
    return table


def find_cmake() -> str | None:
    """The CMake binary of the `cmake` wheel in this interpreter, else the one on PATH.

    The binary inside the package (cmake.CMAKE_BIN_DIR), not the venv's bin/cmake: that is a pip console
    script whose shebang names the interpreter path pip ran under, which for a venv reached through a link
    (the per-machine contract venv) can be a clone that no longer exists.
    """
    try:
        import cmake  # the PyPI wheel tests/contract/setup_vllm_env.sh installs
    except ImportError:
        return shutil.which("cmake")
    exe = Path(cmake.CMAKE_BIN_DIR) / "cmake"
    return str(exe) if exe.exists() else shutil.which("cmake")
