"""`beamc logits`: run a ragged prefill (and optional greedy decode steps) through the IR interpreter (or, with
`--backend compiled`, through the generated package and `runtime.model.Model`) and write the logits with the tokens
they belong to, so a user can compare beamc against any other implementation. `beamc generate`: a prompt's
continuation (greedy, temperature, top-p) through either backend, with tokens/s.

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
from beamc.runtime.session import ReferenceSession, check_dtype
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


BACKENDS = ("interpreter", "compiled")


def use_cpu_interpreter(device: str) -> None:
    """The compiled backend on a CPU runs the generated Triton kernels under Triton's interpreter, which reads
    TRITON_INTERPRET when a kernel module is imported: set it before any is (this process imports none before)."""
    import os

    if torch.device(device).type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"


class CompiledSession:
    """The compiled runtime behind the ReferenceSession's calls (`prefill(chunks)`, `decode({slot: token})`): the
    spec's package for one rank, compiled into a temporary directory and loaded by `runtime.model.Model`."""

    def __init__(self, spec, ckpt, *, dtype: str = "f32", device: str = "cpu", passes=(), max_seqs: int = 1,
                 max_len: int = 64, max_chunk: int = 64, max_logit_rows: int | None = None):
        import tempfile

        from beamc.codegen.package import compile_package
        from beamc.runtime.model import Model

        check_backend("compiled", tp=1, device=device, dtype=dtype)
        pkg = compile_package(spec, passes=list(passes), dtype="f32" if dtype == "f32" else None)
        use_cpu_interpreter(device)  # after the last check: a refused command leaves the environment as it was
        self._dir = tempfile.TemporaryDirectory(prefix="beamc_pkg_")
        pkg.write(self._dir.name)
        (Path(self._dir.name) / "spec.json").write_text(spec.model_dump_json())
        self.model = Model.load(self._dir.name, ckpt, spec=spec, device=device, max_batch=max_seqs,
                                max_context=max_len, max_prefill_tokens=max_chunk, max_logit_rows=max_logit_rows)

    def prefill(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        return self.model.prefill([s for s, _ in chunks], [t for _, t in chunks], all_logits=True)

    def decode(self, tokens: dict[int, int]) -> torch.Tensor:
        return self.model.decode(list(tokens), list(tokens.values()))


def check_backend(backend: str, *, tp: int, device: str, dtype: str) -> None:
    """What the compiled backend cannot do, refused before any work."""
    if backend != "compiled":
        return
    if tp != 1:
        raise BeamcError("--tp", f"{tp}: the compiled backend runs one rank per process (tp 1 here)",
                         "use --backend interpreter for simulated tensor parallelism")
    if torch.device(device).type == "cpu" and ir_dtype(dtype) != "f32":
        raise BeamcError("--dtype", f"{dtype}: on a CPU the compiled backend runs the fp32 package under Triton's "
                         "interpreter", "use --dtype f32, or --device cuda")


def open_session(backend: str, spec, ckpt, *, dtype: str, tp: int, device: str, passes=(), graphs=None,
                 max_seqs: int, max_len: int, max_chunk: int):
    if backend == "interpreter":
        return ReferenceSession.from_checkpoint(spec, ckpt, tp=tp, dtype=dtype, device=device, max_seqs=max_seqs,
                                                max_len=max_len, max_chunk=max_chunk, graphs=graphs)
    check_backend(backend, tp=tp, device=device, dtype=dtype)
    return CompiledSession(spec, ckpt, dtype=dtype, device=device, passes=passes, max_seqs=max_seqs,
                           max_len=max_len, max_chunk=max_chunk, max_logit_rows=max_chunk)


def run_logits(spec, ckpt, seqs: list[list[int]], steps: int, *, dtype: str = "f32", tp: int = 1,
               device: str = "cpu", graphs=None, backend: str = "interpreter",
               passes=()) -> dict[str, torch.Tensor]:
    longest = max(len(s) for s in seqs)
    total = sum(len(s) for s in seqs)  # the compiled runtime prefills the whole batch in one step
    sess = open_session(backend, spec, ckpt, dtype=dtype, tp=tp, device=device, passes=passes, graphs=graphs,
                        max_seqs=len(seqs), max_len=longest + steps,
                        max_chunk=longest if backend == "interpreter" else total)
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
    check_backend(getattr(args, "backend", "interpreter"), tp=args.tp, device=args.device, dtype=args.dtype)
    check_dtype(spec, args.dtype, "--dtype")
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
    backend = getattr(args, "backend", "interpreter")
    if backend == "compiled":
        out = run_logits(spec, args.checkpoint, seqs, steps, dtype=dtype, tp=args.tp, device=args.device,
                         backend=backend, passes=names)
    else:
        graphs = compile_graphs(spec, tp=args.tp, dtype=dtype, passes=names)
        out = run_logits(spec, args.checkpoint, seqs, steps, dtype=dtype, tp=args.tp, device=args.device,
                         graphs=graphs)
    meta = {"spec": spec.name, "dtype": dtype, "tp": str(args.tp), "backend": backend,
            "passes": ",".join(names) or "none"}
    ensure_dir(Path(args.output).parent, "-o")
    try:
        save_file(out, args.output, metadata=meta)
    except Exception as e:  # safetensors raises its own SafetensorError, not OSError, for I/O failures
        reason = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).splitlines() or [repr(e)])[0]
        raise BeamcError("-o", f"cannot write {args.output}: {reason}", "choose another path") from None
    print(f"wrote {args.output}: {len(seqs)} sequences ({sum(map(len, seqs))} prefill tokens), "
          f"{steps} decode steps, {dtype}, tp {args.tp}, passes: {meta['passes']}"
          + (f", backend: {backend}" if backend != "interpreter" else ""))


def parse_ids(text: str, vocab: int, where: str = "--prompt-ids") -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise BeamcError(where, f"{text!r} is not a comma-separated list of token ids", "e.g. 1,2,3") from None
    if not ids:
        raise BeamcError(where, "no token ids given", "e.g. 1,2,3")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise BeamcError(where, f"token id {bad[0]} outside the vocabulary [0, {vocab})")
    return ids


def generate_command(args: argparse.Namespace) -> None:
    """`beamc generate`: the prompt, then --max-new tokens sampled one decode step at a time; prints the tokens and
    tokens/s (of the decode steps after the prefill), or with --json one object for scripts."""
    import time

    from beamc.runtime.sampling import check_params, generator, sample

    check_device(args.device)
    check_backend(args.backend, tp=1, device=args.device, dtype=args.dtype)
    spec = load_spec(args.spec)
    check_dtype(spec, args.dtype, "--dtype")
    names = select_passes(args.passes, [d for d in args.disable.split(",") if d])
    prompt = parse_ids(args.prompt_ids, spec.vocab_size)
    if args.max_new < 1:
        raise BeamcError("--max-new", f"must be >= 1, got {args.max_new}")
    check_params(args.temperature, args.top_p, ("--temperature", "--top-p"))
    total = len(prompt) + args.max_new
    if total > spec.max_position_embeddings:
        raise BeamcError("--max-new", f"{len(prompt)} prompt tokens + {args.max_new} new exceed the spec's "
                         f"max_position_embeddings ({spec.max_position_embeddings})")
    check_checkpoint_readable(spec, args.checkpoint)
    dtype = ir_dtype(args.dtype)
    graphs = compile_graphs(spec, dtype=dtype, passes=names) if args.backend == "interpreter" else None
    sess = open_session(args.backend, spec, args.checkpoint, dtype=dtype, tp=1, device=args.device, passes=names,
                        graphs=graphs, max_seqs=1, max_len=total, max_chunk=len(prompt))
    gen = generator(args.seed, args.device)
    t0 = time.perf_counter()
    logits = sess.prefill([(0, prompt)])[0][-1:]
    t1 = time.perf_counter()
    tokens = []
    while True:
        tok = int(sample(logits, args.temperature, args.top_p, gen)[0])
        tokens.append(tok)
        if len(tokens) == args.max_new:
            break
        logits = sess.decode({0: tok})
    if torch.device(args.device).type == "cuda":
        torch.cuda.synchronize(args.device)
    t2 = time.perf_counter()
    decode_s = t2 - t1
    rate = (len(tokens) - 1) / decode_s if len(tokens) > 1 and decode_s > 0 else len(tokens) / max(t2 - t0, 1e-9)
    if args.json:
        print(json.dumps({"tokens": tokens, "tokens_per_s": rate, "prefill_s": t1 - t0,
                          "backend": args.backend, "device": args.device, "dtype": dtype,
                          "prompt_tokens": len(prompt)}))
    else:
        print(" ".join(map(str, tokens)))
        print(f"{len(tokens)} tokens, {rate:.2f} tokens/s (decode), prefill of {len(prompt)} tokens "
              f"{(t1 - t0) * 1e3:.1f} ms; backend {args.backend}, {args.device}, {dtype}")
