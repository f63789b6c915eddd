"""moe_router at T = 1 (batch-1 decode) on the GPU, one TP-8 rank of the full spec: the VARIANTS of the selection stage
(its warps), each a CUDA-graph replay of 50 launches (bench/kernels.py graph_time); outputs checked bitwise equal (ids
and weights) across variants.

    python bench/router_decode.py --out $OUT
    python bench/router_decode.py --out $OUT --tokens 8,16,32,64     (batch decode: the paths by token count)

With --tokens: at each T the decode steps' router (the small-M path: a GEMV split over experts, K and blocks of 8
tokens) against the prefill one (the large path as the emitter renders it on sm90: BF16X3 MMAs, K split where the
tiles are fewer than a wave), each a graph replay of 50 launches; the share of ids equal to the small path's (the
logits are fp32 sums in another order: a near-tie may flip) and the largest logit difference. At batch 64 the small
path took 2,048 us of a 26.9 ms step (42 us a layer; H100, s48run4).
"""
from __future__ import annotations

import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from beamc.codegen.kernel import KernelSpec, load_kernel  # noqa: E402
from beamc.spec import load_spec  # noqa: E402


# (label, render options): the selection stage's warps (H200, 2026-12-01: 4 warps 7.15 us, 2 warps 6.71, 1 warp 6.28,
# now the default; a since-removed option that gathered the chosen weights from the stored logits instead of a masked
# sum per choice: 6.73 at 4 warps, 6.37 at 1; the one-launch option, ONE_LAUNCH: 8.26 against 7.11 the session before)
# SELECT_SORT (2026-12-02): the groups and the experts by bitonic top-k over packed keys instead of ~30 serial reductions
# (the default since; measured against it: the iterative selection)
VARIANTS = (("1 warp, iterative", {"SELECT_SORT": False}), ("1 warp (default: SELECT_SORT)", {}),
            ("2 warps", {"SELECT_WARPS": 2}), ("1 warp, iterative, again", {"SELECT_SORT": False}),
            ("1 warp (default, again)", {}))


def by_tokens(tokens: list[int], out: Path | None) -> int:
    """The small-M path against the large one at each T (see the module docstring)."""
    import kernels
    from test_kernels_attn_router import router_constants

    from beamc.codegen import emitters

    spec = load_spec(ROOT / "models/beam.yaml")
    kdir = tempfile.mkdtemp()
    c = router_constants(spec, "small")
    mods = {"small": load_kernel(KernelSpec("moe_router", "moe_router", c), kdir),
            "large": load_kernel(KernelSpec("moe_router", "moe_router", dict(c, PATH="large",
                                                                              **emitters.ROUTER_PREFILL_TILES)), kdir)}
    g = torch.Generator(device="cuda").manual_seed(0)
    W = torch.randn(c["E"], c["H"], device="cuda", generator=g) * 0.02
    bias = torch.randn(c["E"], device="cuda", generator=g) * 0.01
    rows = []
    for T in tokens:
        x = torch.randn(T, c["H"], device="cuda", generator=g).to(torch.bfloat16)
        got = {}
        for name, mod in mods.items():
            w = torch.full((T, c["TOP_K"]), float("nan"), device="cuda")
            ids = torch.full((T, c["TOP_K"]), -1, dtype=torch.int64, device="cuda")
            scratch = torch.empty(mod.scratch_numel(T), device="cuda")
            t = kernels.graph_time(lambda: mod.launch(x, W, bias, w, ids, scratch), 50)
            got[name] = (t * 1e6, ids.clone(), mod.logits(scratch, T).clone())
        same = (got["large"][1].sort(1).values == got["small"][1].sort(1).values).all(1).float().mean().item()
        row = dict(T=T, small_us=got["small"][0], large_us=got["large"][0], rows_same_ids=same,
                   max_logit_diff=(got["large"][2] - got["small"][2]).abs().max().item())
        rows.append(row)
        print(row, flush=True)
    print(f"{'T':>4}{'small us':>10}{'large us':>10}{'same ids':>10}")
    for r in rows:
        print(f"{r['T']:>4}{r['small_us']:>10.2f}{r['large_us']:>10.2f}{r['rows_same_ids']:>10.1%}")
    if out:
        date = datetime.date.today().isoformat()
        doc = dict(date=date, command=" ".join(["python"] + sys.argv), device=torch.cuda.get_device_name(), rows=rows)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"router-decode-tokens-{date}.json").write_text(json.dumps(doc, indent=1))
    return 0


def main() -> int:
    import kernels
    from test_kernels_attn_router import router_constants

    out = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else None
    if "--tokens" in sys.argv:
        return by_tokens([int(t) for t in sys.argv[sys.argv.index("--tokens") + 1].split(",")], out)
    c = router_constants(load_spec(ROOT / "models/beam.yaml"), "small")
    kdir = tempfile.mkdtemp()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, c["H"], device="cuda", generator=g).to(torch.bfloat16)
    W = torch.randn(c["E"], c["H"], device="cuda", generator=g) * 0.02
    bias = torch.randn(c["E"], device="cuda", generator=g) * 0.01
    recs = {}
    for label, extra in VARIANTS:
        mod = load_kernel(KernelSpec("moe_router", "moe_router", dict(c, **extra)), kdir)
        w = torch.full((1, c["TOP_K"]), float("nan"), device="cuda")
        ids = torch.full((1, c["TOP_K"]), -1, dtype=torch.int64, device="cuda")
        scratch = torch.empty(mod.scratch_numel(1), device="cuda")
        t = kernels.graph_time(lambda: mod.launch(x, W, bias, w, ids, scratch), 50)
        recs[label] = dict(us=t * 1e6, ids=ids.tolist(), weights=w.tolist())
        print(f"moe_router T=1 {label}: {t * 1e6:.2f} us")
    same = all(r["ids"] == recs[VARIANTS[0][0]]["ids"] and r["weights"] == recs[VARIANTS[0][0]]["weights"]
               for r in recs.values())
    print(f"ids and weights bitwise equal across variants: {same}")
    if out:
        date = datetime.date.today().isoformat()
        doc = dict(date=date, command="python bench/router_decode.py --out $OUT", device=torch.cuda.get_device_name(),
                   records=recs, ids_equal=same)
        (out / f"router-decode-{date}.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
