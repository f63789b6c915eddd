"""Check every kernel of a generated package against its op's reference, on one device, and print a table.

    python -m beamc.codegen.selfcheck SPEC [--tp N --rank r] [--dtype bf16|f32] [--device cuda] [--tokens 1,300]
                                      [--phases decode,prefill] [--json OUT.json]

For each phase and token count, the first node of every distinct kernel (or kernel chain: the library GEMM and its
epilogue kernel) runs on fresh random inputs with poisoned outputs and is compared element by element with
`beamc.ir.reference` on the same inputs (`beamc.codegen.check`). On CPU set TRITON_INTERPRET=1 and use --dtype f32
(Triton's interpreter mishandles bf16). The exit status is 0; the table and the JSON carry the verdicts.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile

from beamc.codegen.check import check_node
from beamc.codegen.package import compile_package
from beamc.passes.manager import PASSES
from beamc.spec import load_spec


def distinct_kernel_nodes(pkg, phase: str) -> list[tuple]:
    """(node, its launches) for the first node that uses each distinct chain of kernels in a step."""
    seen, out = set(), []
    for node, lns in pkg.steps[phase].by_node():
        names = tuple(ln.kernel.name for ln in lns if ln.kernel is not None)
        if names and names not in seen:
            seen.add(names)
            out.append((node, lns))
    return out


def run(spec, *, tp: int = 1, rank: int = 0, dtype: str | None = None, device: str = "cpu",
        tokens: tuple[int, ...] = (1, 37), phases: tuple[str, ...] = ("decode", "prefill"), slots: int = 3,
        kernel_dir: str | None = None, seed: int = 0, pdl: bool = True) -> list[dict]:
    pkg = compile_package(spec, tp=tp, rank=rank, passes=list(PASSES), dtype=dtype, phases=phases, pdl=pdl)
    kdir = kernel_dir or tempfile.mkdtemp(prefix="beamc_selfcheck_")
    rows = []
    for phase in phases:
        for T in tokens:
            mp = (530 + T) // 16 + 2  # pages per sequence: positions start at 530
            # a decode step brings one token per sequence (the runtime refuses a sequence twice; the qk_attention
            # kernel relies on it), so decode checks give every token its own slot
            S = max(slots, T) if phase == "decode" else slots
            sizes = {"T": T, "B": T, "S": S, "Cs": spec.effective_window - 1 + T, "P": S * mp, "MP": mp,
                     "R": min(T, 2), "V": spec.vocab_size, "E": spec.mlp.moe.num_experts, "P0": 530}
            for i, (node, lns) in enumerate(distinct_kernel_nodes(pkg, phase)):
                c = check_node(node, lns, sizes, device=device, seed=seed + 1000 * T + i, kernel_dir=kdir)
                rows.append({"phase": phase, "tokens": T, **c.as_dict()})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m beamc.codegen.selfcheck", description=__doc__.splitlines()[0])
    p.add_argument("spec")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--dtype", default=None, help="f32 for CPU (interpreter) instances; default: the spec's")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", default="1,37")
    p.add_argument("--phases", default="decode,prefill")
    p.add_argument("--json", default=None)
    p.add_argument("--no-pdl", dest="pdl", action="store_false", help="kernels without Programmatic Dependent Launch")
    a = p.parse_args(argv)
    rows = run(load_spec(a.spec), tp=a.tp, rank=a.rank, dtype=a.dtype, device=a.device,
               tokens=tuple(int(t) for t in a.tokens.split(",")), phases=tuple(a.phases.split(",")), pdl=a.pdl)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    for r in rows:
        print(f"{r['phase']:<8} T={r['tokens']:<5} {r['op']:<15} L{r['layer']!s:<3} {r['kernel'][:40]:<40} "
              f"mismatch {r['mismatches']}/{r['elements']}  max_ulp {r['max_ulp']}  max_rel {r['max_rel']:.2e}  "
              f"nan {r['nan']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
