"""The router's binaries' local memory and what launching them takes of the GPU's free memory: the template as it is
(each launch its own binary, STAGE pinned) against a saved earlier one (`--old TEMPLATE`: one binary for stages 0 / 1
with a runtime stage, whose one-warp selection binary compiled ahead of time holds stage 0's GEMM at one warp: 25,424
bytes of stack a thread by ptxas). Each render in a fresh process (the driver keeps the largest local memory it has
reserved). H100, s40run1: 0 MB and 0 bytes for both: Triton's JIT specialises stage = 1 (an integer argument equal to
1), so the binary it launched for the selection had no GEMM in it.

    git show 4b19e63:beamc/codegen/templates/moe_router.py.j2 > /tmp/old/moe_router_s39.py.j2   # (before STAGE)
    python bench/router_local_memory.py --out $OUT [--old /tmp/old/moe_router_s39.py.j2]
"""
from __future__ import annotations

import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def measure(template: str | None) -> dict:
    """In this process: render (the package's template, or the file `template`), launch the large path once at 4,096
    tokens, and report the free-memory drop and each loaded binary's local bytes a thread."""
    import jinja2
    import torch

    from beamc.codegen import kernel as K
    from beamc.spec import load_spec
    from conftest import loaded_local_bytes
    from test_kernels_attn_router import router_constants

    c = router_constants(load_spec(ROOT / "models/beam.yaml"), "large")
    if template:
        env = K._ENV.overlay(loader=jinja2.FileSystemLoader([str(Path(template).parent), str(K.TEMPLATES)]))
        src = env.get_template(Path(template).name).render(TL_DTYPE=K.TL_DTYPE, TL_TYPE=K.TL_TYPE, **c)
        mod = K.load_source(src, "moe_router_old", tempfile.mkdtemp())
    else:
        mod = K.load_kernel(K.KernelSpec("moe_router", "moe_router", c), tempfile.mkdtemp())
    T = 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, c["H"], device="cuda", generator=g).to(torch.bfloat16)
    W = torch.randn(c["E"], c["H"], device="cuda", generator=g) * 0.02
    bias = torch.randn(c["E"], device="cuda", generator=g) * 0.01
    w = torch.empty((T, c["TOP_K"]), device="cuda")
    ids = torch.empty((T, c["TOP_K"]), dtype=torch.int64, device="cuda")
    scratch = torch.empty(mod.scratch_numel(T), device="cuda")
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    mod.launch(x, W, bias, w, ids, scratch)
    torch.cuda.synchronize()
    free1 = torch.cuda.mem_get_info()[0]
    return dict(free_drop_mb=(free0 - free1) / 2**20, local_bytes=loaded_local_bytes(mod.kernel), ids=ids.sum().item())


def main() -> int:
    args = sys.argv[1:]
    if args and args[0] == "--child":
        print(json.dumps(measure(args[1] if len(args) > 1 else None)))
        return 0
    out = Path(args[args.index("--out") + 1]) if "--out" in args else None
    old = args[args.index("--old") + 1] if "--old" in args else None
    import torch

    rows = {}
    for label, extra in (("now", []),) + ((("old", [old]),) if old else ()):
        r = subprocess.run([sys.executable, __file__, "--child", *extra], capture_output=True, text=True)
        rows[label] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else dict(error=r.stderr[-2000:])
    rec = dict(date=str(datetime.date.today()), command="python " + " ".join(sys.argv),
               device=torch.cuda.get_device_name(), records=rows)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "router-local-memory.json").write_text(json.dumps(rec, indent=1))
    print(f"{'render':<6} {'free MB taken':>14} {'local bytes a thread (each binary)':>36}")
    for label, r in rows.items():
        print(f"{label:<6} {r.get('free_drop_mb', float('nan')):>14.0f} {str(r.get('local_bytes', r.get('error', '')[-60:])):>36}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
