"""FlashInfer's own AOT build (``python -m flashinfer.aot``) limited to the modules the served methods load.

    SPARKLLM_FLASHINFER_AOT_EXCLUDE="REGEX ..." python3 flashinfer_aot.py AOT-ARGUMENTS...

Runs the installed release's ``flashinfer.aot.main()`` with AOT-ARGUMENTS (its own options: the families
and variants it generates), after wrapping that module's ``gen_all_modules`` so every module whose name
matches one of the space-separated regexes is left out before anything is compiled. Its options cannot
drop the rest: ``--f8-dtype`` given no value keeps the default (FP8-E4M3 KV variants of every attention
module), the MLA module is generated unconditionally, and ``--add-misc`` brings the Mamba
``selective_state_update`` modules with the sampling and norm kernels (0.6.6 aot.py ``gen_attention``,
``gen_all_modules``, ``main``; tests/contract/test_flashinfer_aot_contract.py checks it per release). A module
left out is JIT-compiled at its first use, as without AOT: a wrong exclusion costs time, not correctness.
Runs inside the image (standard library besides FlashInfer itself); exit status that of aot.main(), 2 for
a bad regex.
"""

from __future__ import annotations

import os
import re
import sys


def main() -> int:
    try:
        exclude = [re.compile(p) for p in os.environ.get("SPARKLLM_FLASHINFER_AOT_EXCLUDE", "").split()]
    except re.error as exc:
        print(f"flashinfer_aot: bad SPARKLLM_FLASHINFER_AOT_EXCLUDE pattern: {exc}", file=sys.stderr)
        return 2
    import flashinfer.aot as aot  # noqa: PLC0415 - after the argument check: importing torch takes seconds

    generate = aot.gen_all_modules

    def limited(*args, **kwargs):
        specs = generate(*args, **kwargs)
        kept = [s for s in specs if not any(p.search(s.name) for p in exclude)]
        left = sorted(s.name for s in specs if s not in kept)
        print(f"sparkllm: FlashInfer AOT: {len(kept)} of {len(specs)} modules; left to the JIT: "
              f"{len(left)} ({' '.join(left) or 'none'})", flush=True)
        return kept

    aot.gen_all_modules = limited  # compile_and_package_modules looks it up in the module at call time
    sys.argv = ["flashinfer.aot", *sys.argv[1:]]
    aot.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
