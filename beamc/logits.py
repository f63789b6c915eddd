"""`beamc logits`: run a ragged prefill (and optional greedy decode steps) through the IR interpreter and write
the logits with the tokens they belong to, so a user can compare beamc against any other implementation.

Input JSON: {"sequences": [[token ids], ...], "decode_steps": 0}  (a bare list of lists is accepted too).
Output safetensors: prefill.{i}.tokens [n_i], prefill.{i}.logits [n_i, V] (fp32); with decode steps,
decode.tokens [steps, B] (the token fed at each step: the greedy choice of the step before) and
decode.logits [steps, B, V].
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from beamc.errors import BeamcError, ensure_dir
from beamc.ir.session import ReferenceSession
from beamc.passes.manager import compiled_graphs, select_passes
from beamc.spec import load_spec


def read_batch(path: str | Path, vocab: int) -> tuple[list[list[int]], int]:
    p = Path(path)
    if not p.is_file():
        raise BeamcError(str(p), "input file not found")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise BeamcError(f"{p}:{e.lineno}", f"not valid JSON: {e.msg}") from None
    if isinstance(data, list):
        data = {"sequences": data}
    if not isinstance(data, dict) or not isinstance(data.get("sequences"), list) or not data["sequences"]:
        raise BeamcError(str(p), 'expected {"sequences": [[token ids], ...], "decode_steps": N}')
    unknown = set(data) - {"sequences", "decode_steps"}
    if unknown:
        raise BeamcError(str(p), f"unknown keys {sorted(unknown)}", 'allowed: "sequences", "decode_steps"')
    seqs = data["sequences"]
    for i, s in enumerate(seqs):
        if not isinstance(s, list) or not s or not all(isinstance(t, int) and not isinstance(t, bool) for t in s):
            raise BeamcError(f"{p}: sequences[{i}]", "must be a non-empty list of integer token ids")
        bad = [t for t in s if not 0 <= t < vocab]
        if bad:
            raise BeamcError(f"{p}: sequences[{i}]", f"token id {bad[0]} outside the vocabulary [0, {vocab})")
    steps = data.get("decode_steps", 0)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise BeamcError(f"{p}: decode_steps", f"must be a non-negative integer, got {steps!r}")
    return seqs, steps


def run_logits(spec, ckpt, seqs: list[list[int]], steps: int, *, dtype: str = "f32", tp: int = 1,
               device: str = "cpu", graphs=None) -> dict[str, torch.Tensor]:
    longest = max(len(s) for s in seqs)
    sess = ReferenceSession.from_checkpoint(spec, ckpt, tp=tp, dtype=dtype, device=device, max_seqs=len(seqs),
                                            max_len=longest + steps, max_chunk=longest, graphs=graphs)
    out: dict[str, torch.Tensor] = {}
    prefill = sess.prefill(list(enumerate(seqs)))
    for i, (s, lg) in enumerate(zip(seqs, prefill)):
        out[f"prefill.{i}.tokens"] = torch.tensor(s, dtype=torch.int64)
        out[f"prefill.{i}.logits"] = lg.float().cpu().contiguous()
    if steps:
        nxt = [int(lg[-1].argmax()) for lg in prefill]
        toks, logits = [], []
        for _ in range(steps):
            toks.append(nxt)
            lg = sess.decode(dict(enumerate(nxt)))
            logits.append(lg.float().cpu())
            nxt = lg.argmax(-1).tolist()
        out["decode.tokens"] = torch.tensor(toks, dtype=torch.int64)
        out["decode.logits"] = torch.stack(logits).contiguous()
    return out


def logits_command(args: argparse.Namespace) -> None:
    spec = load_spec(args.spec)
    seqs, steps = read_batch(args.input, spec.vocab_size)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise BeamcError("--device", f"{args.device} requested but CUDA is not available", "use --device cpu")
    dtype = "f32" if args.dtype == "fp32" else "bf16"
    names = select_passes(args.passes, [d for d in args.disable.split(",") if d])
    graphs = compiled_graphs(spec, tp=args.tp, dtype=dtype, passes=names)
    out = run_logits(spec, args.checkpoint, seqs, steps, dtype=dtype, tp=args.tp, device=args.device, graphs=graphs)
    meta = {"spec": spec.name, "dtype": args.dtype, "tp": str(args.tp), "backend": "interpreter",
            "passes": ",".join(names) or "none"}
    ensure_dir(Path(args.output).parent, "-o")
    try:
        save_file(out, args.output, metadata=meta)
    except OSError as e:
        raise BeamcError("-o", f"cannot write {args.output}: {e.strerror}", "choose another path") from None
    print(f"wrote {args.output}: {len(seqs)} sequences ({sum(map(len, seqs))} prefill tokens), "
          f"{steps} decode steps, {args.dtype}, tp {args.tp}, passes: {meta['passes']}")
