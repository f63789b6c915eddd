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

from beamc.checkpoint.layout import check_tp
from beamc.checkpoint.loader import INDEX_NAME, check_checkpoint, checkpoint_files
from beamc.compiler import compile_graphs
from beamc.errors import BeamcError, check_output_file, check_readable, ensure_dir, read_error
from beamc.ir.dtypes import ir_dtype
from beamc.passes.manager import select_passes
from beamc.runtime.session import ReferenceSession
from beamc.spec import load_spec

MAX_INPUT_BYTES = 64 << 20  # a batch file of token ids; anything larger is a wrong path
DEVICE_FORMS = "cpu, cuda or cuda:N"


def read_batch(path: str | Path, vocab: int) -> tuple[list[list[int]], int]:
    p = Path(path)
    if not p.exists():
        raise BeamcError(str(p), "input file not found")
    check_readable(p, "--input")
    if p.stat().st_size > MAX_INPUT_BYTES:
        raise BeamcError("--input", f"{p} is {p.stat().st_size} bytes, more than the {MAX_INPUT_BYTES >> 20} MiB "
                         "limit for a batch file")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise BeamcError(f"{p}:{e.lineno}", f"not valid JSON: {e.msg}") from None
    except UnicodeDecodeError:
        raise BeamcError(str(p), "not a UTF-8 text file; expected JSON") from None
    except OSError as e:
        raise read_error(p, e, "--input") from None
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


def check_device(device: str) -> torch.device:
    """`--device` as a torch.device, or one BeamcError naming the valid forms (cpu, cuda, cuda:N)."""
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise BeamcError("--device", f"unknown device {device!r}", f"use {DEVICE_FORMS}") from None
    if d.type == "cpu":
        return d
    if d.type != "cuda":
        raise BeamcError("--device", f"{device!r} is not supported", f"use {DEVICE_FORMS}")
    if not torch.cuda.is_available():
        raise BeamcError("--device", f"{device} requested but CUDA is not available", "use --device cpu")
    n = torch.cuda.device_count()
    if d.index is not None and d.index >= n:
        raise BeamcError("--device", f"{device} does not exist: this machine has {n} CUDA device(s)",
                         f"use cpu, cuda or cuda:0..cuda:{n - 1}")
    return d


def check_checkpoint_readable(spec, ckpt: str | Path) -> None:
    """Every file of the checkpoint can be opened, and its headers match the spec: checked before any compute."""
    d = Path(ckpt)
    for name in ("config.json", INDEX_NAME):
        if (d / name).exists():
            check_readable(d / name, "--checkpoint")
    for f in checkpoint_files(d):
        check_readable(f, "--checkpoint")
    check_checkpoint(spec, d)


def logits_command(args: argparse.Namespace) -> None:
    # Every argument is checked before anything is computed: device, output path, spec, tp, batch, checkpoint.
    check_device(args.device)
    check_output_file(args.output, "-o")
    spec = load_spec(args.spec)
    check_tp(spec, args.tp)
    names = select_passes(args.passes, [d for d in args.disable.split(",") if d])
    seqs, steps = read_batch(args.input, spec.vocab_size)
    limit = spec.max_position_embeddings
    too_long = [i for i, sq in enumerate(seqs) if len(sq) + steps > limit]
    if too_long:
        i = too_long[0]
        raise BeamcError(f"{args.input}: sequences[{i}]", f"{len(seqs[i])} tokens + {steps} decode steps exceed the "
                         f"spec's max_position_embeddings ({limit})",
                         "shorten the input or raise max_position_embeddings in the spec")
    check_checkpoint_readable(spec, args.checkpoint)
    dtype = ir_dtype(args.dtype)
    graphs = compile_graphs(spec, tp=args.tp, dtype=dtype, passes=names)
    out = run_logits(spec, args.checkpoint, seqs, steps, dtype=dtype, tp=args.tp, device=args.device, graphs=graphs)
    meta = {"spec": spec.name, "dtype": dtype, "tp": str(args.tp), "backend": "interpreter",
            "passes": ",".join(names) or "none"}
    ensure_dir(Path(args.output).parent, "-o")
    try:
        save_file(out, args.output, metadata=meta)
    except Exception as e:  # safetensors raises its own SafetensorError, not OSError, for I/O failures
        reason = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).splitlines() or [repr(e)])[0]
        raise BeamcError("-o", f"cannot write {args.output}: {reason}", "choose another path") from None
    print(f"wrote {args.output}: {len(seqs)} sequences ({sum(map(len, seqs))} prefill tokens), "
          f"{steps} decode steps, {dtype}, tp {args.tp}, passes: {meta['passes']}")
