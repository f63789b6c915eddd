"""Library calls of a generated step, for the ops this stage has no kernel for yet (each names its issue in the
manifest). Each takes the op's inputs then its outputs, like a generated launcher, and writes the outputs in place.
"""
from __future__ import annotations

import torch

from beamc.ir import reference as R


def linear(x, w, out):
    """cuBLAS GEMM: out = x @ w^T (in x's dtype, fp32 accumulation)."""
    torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out=out.reshape(-1, out.shape[-1]))


def linear2(x, w1, w2, out1, out2):
    """Two GEMMs over the same input (gate and up, before the SwiGLU kernel)."""
    linear(x, w1, out1)
    linear(x, w2, out2)


def copy_parts(y, outs):
    """y's consecutive column blocks into the parts' buffers, in order (each as wide as its buffer)."""
    lo = 0
    for o in outs:
        o.copy_(y[..., lo:lo + o.shape[-1]])
        lo += o.shape[-1]


ROW_ALIGN = 8  # output columns a multiple of 8 bf16: 16-byte rows, which cuBLAS's TMA GEMMs need


def _aligned(n: int) -> int:
    return -(-n // ROW_ALIGN) * ROW_ALIGN


def with_row_room(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (contiguous) as a view into storage of N rounded up to a multiple of ROW_ALIGN rows, the rows past
    N zero: the same tensor to every reader, with room for `aligned_rows` behind it (a load-time copy, once)."""
    n, k = w.shape
    n_al = _aligned(n)
    if n_al == n:
        return w
    room = torch.zeros((n_al, k), dtype=w.dtype, device=w.device)
    room[:n].copy_(w)
    return room[:n]


def aligned_rows(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] widened to its storage's rows up to a multiple of ROW_ALIGN where the storage holds them (a weight
    loaded through `with_row_room`), else w itself."""
    n, k = w.shape
    n_al = _aligned(n)
    if n_al == n or not w.is_contiguous():
        return w
    if w.untyped_storage().nbytes() < (w.storage_offset() + n_al * k) * w.element_size():
        return w
    return w.as_strided((n_al, k), (k, 1))


def linear_packed(x, w, *outs):
    """One GEMM over the packed weight, its column blocks copied into the parts' buffers. Over the weight's rows up
    to a multiple of 8 where its storage has them (`with_row_room`): a packed N that is not a multiple of 8 gives output
    rows that are not a multiple of 16 bytes, which keep cuBLAS off its TMA kernels (N = 1,030, a TP-8 rank of a spec
    with one output-gate column per head, 16,384 tokens, H100 s36: 772 -> 278 us; the shipped spec's 1,792 is
    aligned). The extra columns are computed and never copied."""
    copy_parts(x @ aligned_rows(w).t(), outs)


def moe_experts_dense(x, idx, gu, down, out):
    out.copy_(R.moe_experts_ref(x, idx, gu, down, fmt="dense"))


def moe_experts_nvfp4(x, idx, *params_and_out):
    *params, out = params_and_out
    out.copy_(R.moe_experts_ref(x, idx, *params, fmt="nvfp4"))


def attention(q, kc, vc, slot, pos, *extras_and_out, window=None, scale=None, paged=False):
    """extras: a paged cache's block table, then an fp8 cache's k/v scales."""
    *extras, out = extras_and_out
    out.copy_(R.attention_ref(q, kc, vc, slot, pos, *extras, window=window, scale=scale, paged=paged))


def reference_op(*tensors, op: str, n_in: int, attrs: dict):
    """An unfused IR op through its torch reference: its n_in inputs in IR order, then its outputs (written here)."""
    ins, outs = list(tensors[:n_in]), tensors[n_in:]
    for o, r in zip(outs, R.REFS[op](ins, attrs), strict=True):
        o.copy_(r)


def kv_write(kc, vc, k, v, slot, pos, *extras, paged=False):
    """The cache scatter of `kv_write_ref` without its capacity check (checked by the slot table before the step)."""
    bt, k_scale, v_scale = R._split_extras(extras, paged)
    rows = R.cache_rows(kc, slot, pos, bt)
    kc[rows] = R.kv_store(k, kc.dtype, k_scale)
    vc[rows] = R.kv_store(v, vc.dtype, v_scale)


def moe_combine_scale(y, w, idx, out, scale=None):
    """One rank's MoE combine (x routed scale), before the all-reduce."""
    c = R.moe_combine_ref(y, w, idx)
    out.copy_(c * scale if scale is not None else c)


def gather_rows(x, rows, out):
    torch.index_select(x, 0, rows, out=out)


def all_reduce(x, out):
    """The ranks' sum through torch.distributed (one process per rank; `Model.load` refuses tp > 1 without a
    process group). Without one (tp = 1, or a benchmark of one rank's share that skips collectives): a copy."""
    import torch.distributed as dist

    out.copy_(x)
    if dist.is_initialized():
        dist.all_reduce(out)


def all_reduce_(x):
    """The ranks' sum, in place (a boundary's partial sum that nothing else reads). Without a process group (tp = 1,
    or a benchmark of one rank's share that skips collectives): nothing, no copy."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.all_reduce(x)


def all_gather(x, out):
    """The ranks' parts concatenated along the last dim, cut to out's width (a padded vocabulary). A benchmark of one
    rank's share (BEAMC_SKIP_COLLECTIVES=1, no process group): this rank's part, the rest zeros."""
    import torch.distributed as dist

    from beamc.runtime.model import collectives_skipped

    if collectives_skipped() and not dist.is_initialized():
        n = min(x.shape[-1], out.shape[-1])
        out[..., :n].copy_(x[..., :n])
        out[..., n:].zero_()
        return
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    cat = torch.cat(parts, dim=-1)
    out.copy_(cat[..., : out.shape[-1]])
