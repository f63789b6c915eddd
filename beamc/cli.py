"""The `beamc` command line. Each subcommand is a few lines that call into the package; user errors
(`BeamcError`) print one line and exit 2, never a traceback."""
from __future__ import annotations

import argparse
import signal
import sys

from beamc.errors import BeamcError


def _cmd_compile(args: argparse.Namespace) -> None:
    from beamc.errors import check_output_dir
    from beamc.report import compile_command

    if args.dump_ir:
        check_output_dir(args.dump_ir, "--dump-ir")  # before any work, not after the graphs are built
    if getattr(args, "output", None):
        check_output_dir(args.output, "-o")
    compile_command(args)


def _mirror_pages(text: str) -> int | None:
    """--attention-mirror's value: auto (None) or a page count >= 0."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither auto nor a page count") from None


def _cmd_import_hf(args: argparse.Namespace) -> None:
    from beamc.spec.hf import import_hf

    import_hf(args.config, args.output, name=args.name)


def _cmd_init_weights(args: argparse.Namespace) -> None:
    from beamc.checkpoint.init import init_weights, with_experts
    from beamc.ir.dtypes import ir_dtype
    from beamc.spec import load_spec
    from beamc.spec.hf import hf_unexpressed

    spec = load_spec(args.spec)
    out = init_weights(spec, args.output, seed=args.seed, experts=args.experts, force=args.force,
                       overwrite=args.overwrite)
    # init_weights removes the files of an earlier checkpoint first, so these are the ones it wrote
    written = [f for f in sorted(out.iterdir()) if f.is_file() and (f.suffix == ".safetensors" or f.name in (
        "config.json", "hf_quant_config.json", "model.safetensors.index.json"))]
    size = sum(f.stat().st_size for f in written)
    tensors = sum(f.suffix == ".safetensors" for f in written)
    stored = with_experts(spec, args.experts).dtypes.experts  # what --experts made of the spec's
    experts = "nvfp4" if stored == "nvfp4" else ir_dtype(stored)
    if "sparse" not in spec.mlp_types:
        experts = "none (no MoE layer)"
    print(f"wrote {out}: {len(written)} files ({tensors} safetensors), {_size(size)}, experts {experts}")
    unexpressed = hf_unexpressed(spec)
    if unexpressed:  # complete for beamc, which reads the spec; not for transformers, which reads config.json
        print("beamc: warning: config.json cannot carry " + "; ".join(unexpressed) + ": transformers would run this "
              "checkpoint with its hard-coded values (beamc reads the spec)", file=sys.stderr)


def _cmd_logits(args: argparse.Namespace) -> None:
    from beamc.logits import logits_command

    logits_command(args)


def _cmd_generate(args: argparse.Namespace) -> None:
    from beamc.logits import generate_command

    generate_command(args)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _pass_flags(p: argparse.ArgumentParser, default: str = "all") -> None:
    p.add_argument("--passes", default=default, help=f"all | none | a,b,c (default: {default})")
    p.add_argument("--disable", default="", help="comma-separated passes to leave out")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="beamc", description="Compiler for Beam-1.0-501B-A23B")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="parse, validate, lower and verify a spec; print the model summary")
    c.add_argument("spec")
    c.add_argument("--tp", type=int, default=1, help="tensor-parallel size (show one rank's share)")
    c.add_argument("--rank", type=int, default=0, help="which tensor-parallel rank to lower, in [0, tp) (default: 0)")
    c.add_argument("--dump-ir", metavar="DIR", help="write the graphs (text and DOT) before and after each pass to DIR")
    _pass_flags(c)
    c.add_argument("--report", action="store_true",
                   help="ops left in one MoE layer of batch-1 decode, and op counts per layer kind per pass")
    c.add_argument("-o", "--output", metavar="DIR",
                   help="write the generated package (manifest.json, kernels/*.py, step.py) of --rank to DIR")
    c.add_argument("--target", choices=["sm90", "sm100"], default="sm90",
                   help="GPU target of the generated package: sm90 (Hopper, H100/H200) or sm100 (Blackwell)")
    c.add_argument("--no-pdl", dest="pdl", action="store_false",
                   help="generate kernels without Programmatic Dependent Launch (PDL is on by default: verified on "
                        "the H200 to give the same bits, and faster; see docs/perf-log.md)")
    c.add_argument("--nvfp4-relayout", action=argparse.BooleanOptionalAction, default=True,
                   help="the runtime re-lays out the NVFP4 experts at load for the sm90 MoE kernels (on by default: "
                        "MoE decode 3.7x faster at 8 tokens and the TP-8 decode step 3.67 -> 3.38 ms on the H200, "
                        "the same bits in prefill); --no-nvfp4-relayout: the kernels read the ModelOpt bytes as "
                        "stored")
    c.add_argument("--moe-dequant", action=argparse.BooleanOptionalAction, default=True,
                   help="prefills of 4,096 tokens or more dequantise each MoE layer's gate_up experts once into "
                        "bf16 scratch (1.68 GB at TP 8) and run that GEMM on bf16 tiles, from 16,384 tokens the down "
                        "experts too (0.84 GB more) (on by default: the MoE experts 6.45 -> 3.94 ms per layer at "
                        "16,384 tokens on the H200); --no-moe-dequant: the dequantisation stays in the GEMMs' loops "
                        "at every size")
    c.add_argument("--moe-wgmma", action=argparse.BooleanOptionalAction, default=True,
                   help="sm90, bf16, the relayout on: prefills of 4,096 tokens or more run the MoE experts' GEMMs "
                        "as warp-specialised wgmma kernels with the NVFP4 decode in their main loops, no scratch "
                        "(on by default: 1,836 -> 1,476 us per layer at 4,096 tokens and 3,933 -> 3,760 at 16,384 "
                        "on the H200, docs/perf-log.md); --no-moe-wgmma: the --moe-dequant renders as before")
    c.add_argument("--moe-combine-max-tokens", type=int, default=None, metavar="N",
                   help="at TP > 1, steps of up to N tokens run the MoE decode kernel's COMBINE render (the top-k "
                        "combine and x2.5 in its down GEMM's epilogue: one launch less per MoE layer); larger steps "
                        "the expert kernels then moe_combine; 0: off. Default: 4 (on the H200 the whole decode step at 1 "
                        "token 2.59 -> 2.52 ms, sixteenth session; in the batch-8 step on an H100 the planned render "
                        "and moe_combine took 4,250 us against COMBINE's 4,510, even at 4: docs/perf-log.md, "
                        "fiftieth session)")
    c.add_argument("--moe-frag-max-tokens", type=int, default=0, metavar="N",
                   help="decode steps of up to N tokens (at most the COMBINE range) run each MoE layer's experts and "
                        "top-k combine as moe_nvfp4_frag (a Gluon kernel: every warp loads its re-laid-out NVFP4 "
                        "words straight into tensor-core MMA fragments; sm90, bf16, with the NVFP4 relayout); 0, the "
                        "default: off until it measures faster on the H200 (docs/perf-log.md, twenty-fifth session)")
    c.add_argument("--attention-mirror", type=_mirror_pages, default=None, metavar="PAGES|auto",
                   help="full-attention prefill over an fp8 KV cache converts the step's K/V once into a bf16 "
                        "mirror of PAGES pages per launch (2 x PAGES x page size x KV heads x head dim x 2 bytes of "
                        "scratch) instead of converting every tile in the loop; sequences that do not fit read the "
                        "cache as before (the same values; the mirrored pass's own tiles sum in another order). auto "
                        "(the default): pages for 8 sequences of "
                        "max_position_embeddings, at most 512 MiB (the TP-8 prefill step 626 -> 542 ms on the H200); "
                        "0: off")
    c.add_argument("--prefill-attention-gate", action=argparse.BooleanOptionalAction, default=False,
                   help="prefill steps apply the output gate in the attention kernel's epilogue (the attention_gate "
                        "pass's op); by default (--no-prefill-attention-gate) the attention, then the sigmoid_gate "
                        "kernel: the same roundings, and the TP-8 prefill step measured 457 against 461 ms with the "
                        "fused render on the H200 (docs/perf-log.md, twelfth session); decode steps always fuse")
    c.add_argument("--l2-prefetch-mb", type=int, default=None, metavar="MB",
                   help="decode steps prefetch into L2, beside each latency-bound op (attention, MoE experts), the "
                        "weights of the launches after it up to the next such op, at most MB per op (a side-stream "
                        "kernel; no value changes). 0: off. Default: see beamc/codegen/package.py L2_PREFETCH_MB")
    c.add_argument("--set", action="append", default=[], metavar="TEMPLATE.CONSTANT=VALUE",
                   help="pin a template constant in every kernel of the package rendered from TEMPLATE (repeatable; "
                        "e.g. attention_decode.NUM_WARPS=8): for kernel engineers trying a tile or a render option in "
                        "the whole model; recorded in the manifest (values: YAML scalars; the names are checked "
                        "against the templates)")
    c.set_defaults(fn=_cmd_compile)

    h = sub.add_parser("import-hf", help="write the spec YAML for a HF BeamConfig config.json")
    h.add_argument("config")
    h.add_argument("-o", "--output", help="YAML path (default: stdout)")
    h.add_argument("--name", help="model name for the spec (default: from the config's directory)")
    h.set_defaults(fn=_cmd_import_hf)

    w = sub.add_parser("init-weights", help="write a random checkpoint in HF layout")
    w.add_argument("spec")
    w.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="checkpoint directory: new or empty (see --overwrite)")
    w.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    w.add_argument("--experts", choices=["nvfp4", "bf16", "fp16", "fp32"], default=None,
                   help="expert storage (default: the spec's dtypes.experts)")
    w.add_argument("--force", action="store_true", help="write even a checkpoint larger than 64 GiB")
    w.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty directory, replacing the checkpoint there")
    w.set_defaults(fn=_cmd_init_weights)

    lg = sub.add_parser("logits", help="run a ragged prefill (+ decode steps) through the interpreter")
    lg.add_argument("spec")
    lg.add_argument("--checkpoint", required=True, metavar="DIR", help="HF checkpoint directory (safetensors)")
    lg.add_argument("--input", required=True, help='JSON: {"sequences": [[ids...], ...], "decode_steps": 0}')
    lg.add_argument("-o", "--output", required=True, help="safetensors file to write the logits to")
    lg.add_argument("--dtype", choices=["f32", "bf16", "f16", "fp32", "fp16"], default="f32",
                    help="activation dtype, as the IR names it: f32 (logic checks) or the spec's own (bf16, or f16 "
                         "for a float16 spec; fp32 / fp16 are accepted for f32 / f16)")
    lg.add_argument("--tp", type=int, default=1, help="tensor-parallel size (ranks simulated in one process)")
    lg.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    _pass_flags(lg, default="none")
    lg.add_argument("--backend", choices=["interpreter", "compiled"], default="interpreter",
                    help="interpreter: the IR reference; compiled: the generated package through the runtime "
                         "(on a CPU: --dtype f32 under Triton's interpreter; needs --passes all)")
    lg.set_defaults(fn=_cmd_logits)

    gn = sub.add_parser("generate", help="continue a prompt (greedy, temperature, top-p) and report tokens/s")
    gn.add_argument("spec")
    gn.add_argument("--checkpoint", required=True, metavar="DIR", help="HF checkpoint directory (safetensors)")
    gn.add_argument("--prompt-ids", required=True, metavar="IDS", help="the prompt's token ids, e.g. 1,2,3")
    gn.add_argument("--max-new", type=int, default=16, metavar="N", help="tokens to generate (default: 16)")
    gn.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    gn.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold in (0, 1] (default: 1)")
    gn.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    gn.add_argument("--backend", choices=["interpreter", "compiled"], default="compiled",
                    help="compiled (default): the generated package through the runtime; interpreter: the IR "
                         "reference")
    gn.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    gn.add_argument("--dtype", choices=["f32", "bf16", "f16", "fp32", "fp16"], default="f32",
                    help="activation dtype: f32 (default; the only one on a CPU with --backend compiled) or the "
                         "spec's own (bf16, or f16 for a float16 spec)")
    gn.add_argument("--json", action="store_true", help="print one JSON object: tokens, tokens_per_s, backend")
    _pass_flags(gn, default="all")
    gn.set_defaults(fn=_cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    if hasattr(signal, "SIGPIPE") and argv is None:  # `beamc ... | head` ends quietly
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = _parser().parse_args(argv)
    try:
        args.fn(args)
    except BeamcError as e:
        print(f"beamc: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
