"""GEMM-class kernels of one TP-8 rank of Beam (issue 8), timed on the GPU beside cuBLAS and the copy rate.

Imported by `bench/kernels.py` (`bench_cases(graph_time, copy_bw)`); the records join its JSON:
- `gemv` (the generated small-M GEMM with its epilogue) at the full spec's TP-8 shapes (packed QKV+gate, o_proj,
  dense gate_up+SwiGLU, down, lm_head+soft-cap), M = 1, 4, ..., 64, beside the step's library route for the op
  (`baseline_us`: what a step runs where the compiler does not choose the kernel: `beamc.runtime.library`'s cuBLAS
  calls and the generated epilogue kernel after them: QKV+gate one GEMM then the copies into its parts, gate_up two
  GEMMs then the SwiGLU kernel, lm_head the GEMM then the soft-cap kernel) and the bare GEMM (`bare_gemm_us`: one
  `torch.mm` into a fixed output, the epilogue free; until 2026-12-01's twelfth session the choice table compared
  with this one), TB/s of weights streamed;
- `moe_nvfp4_decode` at M = 1, 8, 64 (8 experts per token of 256, NVFP4, re-laid out as the runtime loads them),
  TB/s of the distinct chosen experts' bytes, beside the library route: the same experts' bf16 weights gathered and
  multiplied by torch (bmm), which is what the step does today without the kernel.
Every figure is a CUDA-graph replay (`graph_time`), outputs poisoned before the timing and checked after it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from beamc.codegen.kernel import KernelSpec, load_kernel  # noqa: E402
from beamc.spec import load_spec  # noqa: E402

M_VALUES = (1, 4, 8, 16, 32, 64)


def _gemv_cases(graph_time, kdir, device) -> list[dict]:
    from test_kernels_gemv import TP8, kernel_spec, make_inputs

    out = []
    for name, (epi, K, N, splits) in TP8.items():
        ks, attrs = kernel_spec(epi, K, N, "bf16", splits=splits)
        mod = load_kernel(ks, kdir)
        for M in M_VALUES:
            gen = torch.Generator().manual_seed(M)
            ins, outs = make_inputs(epi, K, N, M, torch.bfloat16, device=device, gen=gen, attrs=attrs)
            got = [torch.full(s, float("nan"), dtype=dt, device=device) for s, dt in outs]
            scratch = torch.empty(mod.scratch_numel(M), dtype=torch.float32, device=device)
            t = graph_time(lambda: mod.launch(*ins, *got, scratch=scratch), 50)
            assert all(not g.isnan().any() for g in got), f"gemv {name} M={M}: unwritten outputs"
            w = torch.cat([x for x in ins[1:]], dim=0) if len(ins) > 2 else ins[1]  # [N_total, K]
            y = torch.empty(M, w.shape[0], dtype=torch.bfloat16, device=device)
            x = ins[0]
            tb = graph_time(lambda: torch.mm(x, w.t(), out=y), 50)
            route, label = _library_route(epi, ins, [s for s, _ in outs], M, N, kdir, device)
            tr = graph_time(route, 50)
            wbytes = sum(a.numel() * a.element_size() for a in ins[1:])
            rec = {"kernel": f"gemv {name}", "op": ks.op, "tokens": M, "us": t * 1e6,
                   "tb_s": wbytes / t / 1e12, "tflops": 2 * M * w.numel() / t / 1e12,
                   "baseline": f"the step's library route: {label}, CUDA graph", "baseline_us": tr * 1e6,
                   "bare_gemm_us": tb * 1e6, "bytes": wbytes, "shape": [K, int(w.shape[0])]}
            if M == 1 and mod.ONE_PASS:  # beside it, T = 1 through partials and a second launch (ONE_PASS off)
                two = load_kernel(kernel_spec(epi, K, N, "bf16", splits=splits, ONE_PASS=False)[0], kdir)
                ref = [g.clone() for g in got]
                got2 = [torch.full_like(g, float("nan")) for g in got]
                t2 = graph_time(lambda: two.launch(*ins, *got2, scratch=scratch), 50)
                rec["two_launch_us"] = t2 * 1e6
                rec["two_launch_rel_diff"] = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                                                 for a, b in zip(got2, ref))
                print(f"gemv {name} M=1: one pass {t * 1e6:.2f} us, two launches {t2 * 1e6:.2f} us, cuBLAS "
                      f"{tb * 1e6:.2f} us, rel diff {rec['two_launch_rel_diff']:.1e}")
            out.append(rec)
    return out


def _library_route(epi: str, ins, out_shapes, M: int, N: int, kdir, device):
    """(fn, label): the launches a decode step runs for this op where the compiler does not choose the gemv kernel
    (`beamc.codegen.emitters`: the library call of `beamc.runtime.library`, then the generated epilogue kernel),
    into buffers of their own."""
    from beamc.runtime import library as L

    dt = torch.bfloat16
    if epi == "swiglu":  # linear2 into two scratch buffers, then the SwiGLU kernel
        g, u, o = (torch.empty(M, N, dtype=dt, device=device) for _ in range(3))
        sw = load_kernel(KernelSpec("swiglu", "gate_up_swiglu", {"DTYPE": "bf16", "PDL": True, "F": N,
                                                                 "PACKED": False}), kdir)
        return (lambda: (L.linear2(ins[0], ins[1], ins[2], g, u), sw.launch(g, u, o)),
                "linear2 (two cuBLAS GEMMs) + the swiglu kernel")
    if epi == "softcap":  # the lm_head GEMM into a scratch, then the fp32 soft-cap kernel
        raw = torch.empty(M, N, dtype=dt, device=device)
        o = torch.empty(M, N, dtype=torch.float32, device=device)
        sc = load_kernel(KernelSpec("softcap", "linear_softcap", {"DTYPE": "bf16", "PDL": True, "V": N,
                                                                  "CAP": 30.0}), kdir)
        return (lambda: (L.linear(ins[0], ins[1], raw), sc.launch(raw, o)),
                "linear (cuBLAS GEMM) + the softcap kernel")
    outs = [torch.empty(*s, dtype=dt, device=device) for s in out_shapes]
    if epi == "split":
        return lambda: L.linear_packed(ins[0], ins[1], *outs), "linear_packed (one cuBLAS GEMM + a copy per part)"
    return lambda: L.linear(ins[0], ins[1], outs[0]), "linear (cuBLAS GEMM)"


def _moe_cases(graph_time, kdir, device) -> list[dict]:
    from test_kernels_moe import TEMPLATE, distinct_idx, moe_constants, nvfp4_experts

    c = moe_constants(load_spec(ROOT / "models/beam.yaml"), 8, "bf16")
    mod = load_kernel(KernelSpec(TEMPLATE, "moe_experts", c), kdir)
    E, H, I, k = c["E"], c["H"], c["I"], c["TOP_K"]
    params = nvfp4_experts(E, H, I, torch.Generator().manual_seed(0), device=device)
    from beamc.ir.reference import expert_weights  # bf16 copies of every expert for the library route

    pairs = [expert_weights(params, "nvfp4", e, torch.bfloat16) for e in range(E)]
    gu, dn = torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs])
    del pairs
    per_expert = sum(p[0].numel() * p[0].element_size() for p in params)  # one expert's NVFP4 bytes (all parts)
    # the kernel reads the weights as the runtime loads them: re-laid out (the same bytes; the ModelOpt layout's decode
    # is slower: s24run7, T = 8 358 against 93 us)
    relaid = mod.relayout(params)
    out = []
    for M in M_VALUES:
        g = torch.Generator().manual_seed(M)
        x = torch.randn(M, H, generator=g).bfloat16().to(device)
        idx = distinct_idx(M, E, k, g).to(device)
        y = torch.full((M, k, H), float("nan"), dtype=torch.bfloat16, device=device)
        scratch = torch.empty(mod.scratch_numel(M), dtype=torch.bfloat16, device=device)
        t = graph_time(lambda: mod.launch(x, idx, *relaid, y, scratch), 50)
        assert torch.isfinite(y).all(), f"moe M={M}: unwritten outputs"
        flat = idx.flatten()
        xr = x.repeat_interleave(k, dim=0)[:, None, :]  # [M*k, 1, H]

        def library_route():  # gather the chosen experts' bf16 weights, two bmm and SwiGLU
            h = torch.bmm(xr, gu[flat].transpose(1, 2))  # [M*k, 1, 2I]
            a = (torch.nn.functional.silu(h[..., :I].float()) * h[..., I:].float()).bfloat16()
            return torch.bmm(a, dn[flat].transpose(1, 2))

        tb = graph_time(library_route, 10)
        nbytes = per_expert * int(flat.unique().numel())
        out.append({"kernel": "moe_nvfp4_decode", "op": "moe_experts", "tokens": M, "us": t * 1e6,
                    "tb_s": nbytes / t / 1e12, "tflops": 2 * M * k * 3 * H * I / t / 1e12,
                    "baseline": "torch: gather the chosen experts' bf16 weights + bmm + SwiGLU + bmm, CUDA graph",
                    "baseline_us": tb * 1e6, "bytes": nbytes, "experts_read": int(flat.unique().numel())})
    return out


def bench_cases(graph_time, copy_bw: float, read_bw: float | None = None, device: str = "cuda") -> list[dict]:
    import tempfile

    kdir = tempfile.mkdtemp(prefix="beamc_bench_gemm_")
    recs = _gemv_cases(graph_time, kdir, device) + _moe_cases(graph_time, kdir, device)
    for r in recs:
        r["copy_tb_s"] = copy_bw
        r["roofline_us"] = r["bytes"] / ((read_bw or copy_bw) * 1e12) * 1e6  # the weights read once
    return recs
