"""Does a thread's `fence.proxy.async.shared::cta` wait for its own cp.async copies still in flight?

The WGMMA MoE's load partition stores each decoded weight tile to shared memory and then fences it (generic-proxy
writes before the MMA's async-proxy reads); ptxas turns that fence into `MEMBAR.ALL.CTA; FENCE.VIEW.ASYNC.S`. The
same threads issue cp.async copies just before: the A rows of the step (from L2) and, once a run, the weight words of
a run WG_WDEPTH runs ahead (from DRAM). If the MEMBAR waits for those copies to land, every step of the load
partition pays a copy's round trip however deep the ring is, and the cure is to move the copies out of the fencing
threads (words by TMA, A rows by a partition that does not fence) rather than to tune depths. This probe measures it
directly: one program of 4 warps an SM, each thread one 16-byte cp.async (from a line never read before: DRAM; or
from one just read: L2), then the fence, with clock64 read around each; and the same fence with no copy in flight,
and with a st.shared before it (the decode's stores).

    python bench/fence_probe.py --out $OUT          # on the GPU: a table last, fence-probe-<date>.json in OUT
    python bench/fence_probe.py --aot               # on the CPU: compile for sm_90a, print the SASS around the fence

Rows (cycles, median over the threads of each thread's mean over repetitions 1 ..): `issue` (clock before / after the copy's issue), `fence` (around
the fence; `worst`: each program's slowest thread, median over programs), `wait` (around cp.async.wait_group 0 after
it; mode 5, a TMA copy issued by one elected thread: the wait on its mbarrier; mode 6, an async wgmma: the
warpgroup wait). If `fence` with a copy in flight is near the copy's own
latency (the `wait` row with the fence first, or `fence` + `wait`), the fence waits for the copy.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROOT = Path(__file__).resolve().parents[1]
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# (mode, what precedes the fence)
MODES = {0: "nothing in flight", 1: "cp.async from DRAM in flight", 2: "cp.async from L2 in flight",
         3: "cp.async landed (waited first)", 4: "st.shared before it", 5: "TMA copy from DRAM in flight",
         6: "wgmma in flight (64x128x64)"}
REPS = 16
LINE = 128 * 16  # the bytes one program's copy reads (128 threads x 16 bytes)
_TL = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)  # (mode 5's box: [128 rows, 16 B])


@gluon.jit
def _clock(like):
    """clock64 per element of `like` (one read per thread: the tensor holds one element a thread)."""
    return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [like], dtype=gl.int64, is_pure=False,
                                     pack=1)


@gluon.jit
def _probe(src_ptr, src_desc, out_ptr, sink_ptr, MODE: gl.constexpr, REPS: gl.constexpr):
    # one 16-byte copy a thread: [128 threads, 8 bf16]
    L: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [4, 1], [1, 0])
    LT: gl.constexpr = gl.SliceLayout(1, L)
    smem = gl.allocate_shared_memory(gl.bfloat16, [128, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    # (mode 5: the same 2 KB line by one TMA copy, completing on bar: the words-by-TMA design's question)
    tsmem = gl.allocate_shared_memory(gl.bfloat16, [128, 8], src_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    # (mode 6: one warpgroup's wgmma of a K step, m64 n128 k64 from shared memory, as the MoE's MMA partition issues
    # before its next step's fence: does that fence wait for the MMA?)
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    a_s = gl.allocate_shared_memory(gl.bfloat16, [64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16))
    b_s = gl.allocate_shared_memory(gl.bfloat16, [64, 128],
                                    gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16))
    acc = gl.zeros([64, 128], gl.float32, ACC)
    if MODE == 6:
        LA: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        a_s.store(gl.full([64, 64], 1.0, gl.bfloat16, LA))
        b_s.store(gl.full([64, 128], 1.0, gl.bfloat16, LA))
        fence_async_shared()
    pid = gl.program_id(0)
    t = gl.arange(0, 128, layout=LT)
    ptrs = gl.expand_dims(t * 8, 1) + gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, L)), 0)
    tok = t * 0
    issue = gl.zeros([128], gl.int64, LT)
    fence = gl.zeros([128], gl.int64, LT)
    wait = gl.zeros([128], gl.int64, LT)
    for r in gl.static_range(REPS):
        # the line: fresh for every (program, repetition) (DRAM), or the program's first one again (L2: read at r = 0)
        line = (pid * REPS + r) if MODE != 2 else pid * REPS
        src = src_ptr + line.to(gl.int64) * (128 * 8) + ptrs
        t0 = _clock(tok)
        if MODE == 1 or MODE == 2 or MODE == 3:
            _cp_async(smem, src)
            async_copy.commit_group()
        if MODE == 3:
            async_copy.wait_group(0)
        if MODE == 4:
            smem.store(gl.full([128, 8], 1.0, gl.bfloat16, L))
        if MODE == 5:
            mbarrier.expect(bar, 128 * 8 * 2)
            _tma_load(src_desc, [line * 128, 0], bar, tsmem)
        if MODE == 6:
            acc = warpgroup_mma(a_s, b_s, acc, is_async=True)
        t1 = _clock(tok)
        fence_async_shared()
        t2 = _clock(tok)
        if MODE == 5:
            mbarrier.wait(bar, r % 2)
        elif MODE == 6:
            acc = warpgroup_mma_wait(0, deps=(acc, ))
        else:
            async_copy.wait_group(0)
        t3 = _clock(tok)
        if r > 0:  # (repetition 0: cold code, and the L2 fill of mode 2)
            issue += t1 - t0
            fence += t2 - t1
            wait += t3 - t2
    # the sums stored once, after the last fence (a global store in flight would be one more thing for it to wait on)
    base = out_ptr + (pid * 128 + t).to(gl.int64) * 3
    gl.store(base, issue)
    gl.store(base + 1, fence)
    gl.store(base + 2, wait)
    if MODE == 6:  # (the MMAs' result used: stored once, after the last clock)
        gl.store(sink_ptr + pid, gl.sum(gl.sum(acc, axis=1), axis=0))


def _aot() -> None:
    """Compile every mode for sm_90a and print the SASS from the first clock read to the last (the fence's place)."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    for mode in MODES:
        src = GluonASTSource(fn=_probe, signature={"src_ptr": "*bf16", "src_desc": f"tensordesc<bf16[128, 8],{_TL!r}>",
                                                    "out_ptr": "*i64", "sink_ptr": "*fp32", "MODE": "constexpr",
                                                    "REPS": "constexpr"},
                             constexprs={"MODE": mode, "REPS": REPS}, attrs={(0,): [["tt.divisibility", 16]]})
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(ck.asm["cubin"])
            f.flush()
            sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True).stdout
        ops = [ln.split("*/", 1)[1].strip() for ln in sass.splitlines() if "*/" in ln and "/*0" in ln]
        clocks = [i for i, o in enumerate(ops) if "CLOCK" in o]
        first, last = clocks[4], clocks[7]  # (repetition 1's four clock reads)
        print(f"== mode {mode} ({MODES[mode]}):")
        print("\n".join("   " + o.split(";")[0] for o in ops[first:last + 1]))


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--aot", action="store_true", help="compile for sm_90a on the CPU and print the SASS")
    a = ap.parse_args(argv)
    if a.aot:
        _aot()
        return None
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from kernels import copy_bandwidth

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, raw = [], {}
    for mode, what in MODES.items():
        # a fresh source buffer each mode (its lines never read before this mode's programs read them)
        src = torch.randn(sms * REPS * LINE // 2, device="cuda").bfloat16()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        src = torch.empty_like(src).copy_(src)  # (then flushed from L2 by the copy of the next buffer)
        flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        flush.zero_()
        out = torch.full((sms * 128 * 3,), -1, dtype=torch.int64, device="cuda")
        desc = TensorDescriptor(src.view(-1, 8), [src.numel() // 8, 8], [8, 1], [128, 8], _TL)
        sink = torch.zeros(sms, device="cuda")
        _probe[(sms,)](src, desc, out, sink, MODE=mode, REPS=REPS, num_warps=4)
        torch.cuda.synchronize()
        c = out.view(-1, 3).float() / (REPS - 1)  # (per thread: the mean of repetitions 1 ..)
        med = c.median(dim=0).values.tolist()
        # (the worst thread of each program, median over programs: mode 5's copy is issued by one elected thread)
        worst = c[:, 1].view(sms, 128).max(dim=1).values.median().item()
        rows.append(dict(mode=mode, what=what, issue=med[0], fence=med[1], wait=med[2],
                         fence_p90=c[:, 1].quantile(0.9).item(), fence_worst_thread=worst))
        raw[mode] = c[:, 1].tolist()[:256]
    rec = dict(bench="fence_probe", date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(0),
               torch=torch.__version__, copy_tb_s=copy_bandwidth(), rows=rows, fence_samples=raw)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        text = json.dumps({k: v for k, v in rec.items() if k != "fence_samples"}, indent=1)[:-2]
        samples = ",\n".join(f'  "{m}": {json.dumps(v)}' for m, v in raw.items())  # (a line a mode)
        (a.out / f"fence-probe-{rec['date']}.json").write_text(text + ',\n "fence_samples": {\n' + samples + "\n }\n}\n")
    print(f"{'mode':<34}{'issue':>8}{'fence':>8}{'fence p90':>11}{'worst':>8}{'wait':>8}  (cycles, median)")
    for r in rows:
        print(f"{r['what']:<34}{r['issue']:>8.0f}{r['fence']:>8.0f}{r['fence_p90']:>11.0f}"
              f"{r['fence_worst_thread']:>8.0f}{r['wait']:>8.0f}")
    return rec


if __name__ == "__main__":
    main()
