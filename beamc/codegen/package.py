"""`beamc compile -o DIR`: the generated package of one TP rank.

DIR/manifest.json   spec name + hash, target, tp/rank, passes, dtypes; every kernel (template, constants, grid rule,
                    the IR values it reads and writes, weights and their load-time layout, measured or not); every
                    library call with the issue that replaces it; the scratch buffers of each step; the load-time
                    weight transforms the runtime applies (`load_transforms`: the NVFP4 experts' relayout)
DIR/kernels/*.py    one readable Triton module per distinct kernel (nodes with equal constants share one)
DIR/step.py         the decode and prefill schedules: one launch per line in graph order, grouped by layer
DIR/spec.json       the spec it was compiled from (the runtime checks it against the manifest's hash)
DIR/__init__.py     makes DIR importable (`import DIR.step`)
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from beamc.codegen.emitters import Launch, named_params
from beamc.codegen.kernel import KernelSpec, TEMPLATES
from beamc.codegen.overrides import unused as unused_overrides
from beamc.codegen.overrides import validate as validate_overrides
from beamc.codegen.prefetch import plan as prefetch_plan
from beamc.codegen.registry import Context, launches
from beamc.compiler import compile_spec
from beamc.errors import BeamcError, ensure_dir
from beamc.ir.graph import Graph
from beamc.ir.lower import layer_kind
from beamc.ir.ops import OPS
from beamc.spec.schema import ModelSpec

TARGETS = {"sm90": 90, "sm100": 100}
RELAYOUT = "nvfp4 relayout (moe_nvfp4_decode.relayout)"  # the load-time transform of NVFP4 experts (manifest)
MEASURED = {"sm90": "checked on the H200 by tests/gpu (see bench/results/)",
            "sm100": "never: Blackwell is emitted and compile-checked for sm_100a only, never run here"}


@dataclass
class Step:
    phase: str
    graph: Graph
    launches: list[tuple[Any, Launch]] = field(default_factory=list)  # (node, launch) in graph order

    def by_node(self) -> list[tuple[Any, list[Launch]]]:
        """(node, its launches) in graph order."""
        out: dict[int, tuple[Any, list[Launch]]] = {}
        for node, ln in self.launches:
            out.setdefault(id(node), (node, []))[1].append(ln)
        return list(out.values())


@dataclass
class Package:
    spec: ModelSpec
    target: str
    tp: int
    rank: int
    passes: list[str]
    steps: dict[str, Step]
    kernels: dict[str, KernelSpec]  # name -> spec, distinct kernels only
    dtype: str = "bf16"  # the activations' IR dtype the kernels were specialised for
    page_size: int | None = None  # positions per page of the full layers' paged caches (None: no full layers)
    # NVFP4 experts re-laid out at load (`nvfp4_relayouts`). On by default since the H200 run of 2026-12-01: the
    # prefill kernel's re-laid-out path bitwise equal to the ModelOpt path at the TP-8 and odd shapes, and the full
    # TP-8 decode step 3.67 -> 3.38 ms (docs/perf-log.md); off (`--no-nvfp4-relayout`): the kernels read ModelOpt bytes
    nvfp4_relayout: bool = True
    # long prefills (T >= emitters.MOE_DEQUANT_MIN_TOKENS) take the MoE render that dequantises the gate_up weights
    # once per step into scratch, from MOE_DEQUANT_DOWN_MIN_TOKENS the down weights too (on by default since the H200
    # runs of 2026-12-01; off: `--no-moe-dequant`)
    moe_dequant: bool = True
    # sm90 prefills of emitters.MOE_WGMMA_MIN_TOKENS or more (the relayout on, bf16) take the MoE render whose GEMMs
    # run on wgmma with the NVFP4 decode in their main loops (moe_nvfp4_prefill's WGMMA; on by default since the
    # H200 runs of 2026-12-05; off: `--no-moe-wgmma`, then the DEQUANT renders as before)
    moe_wgmma: bool = True
    # up to this many tokens the MoE decode kernel's COMBINE render (the combine_experts pass's op); None: the
    # emitter's default (`emitters.MOE_COMBINE_MAX_TOKENS`, 0: off, slower in the step at T = 1);
    # `--moe-combine-max-tokens`
    moe_combine_max_tokens: int | None = None
    # decode steps of up to this many tokens: the MoE experts with `combine` as the moe_nvfp4_frag kernel
    # (`--moe-frag-max-tokens`; 0, the default: off)
    moe_frag_max_tokens: int = 0
    # > 0: full-attention prefill over fp8 caches converts the step's K/V once into a bf16 mirror of this many pages
    # (`--attention-mirror PAGES|auto`; auto by default since the H200 run of 2026-12-01: `auto_mirror_pages`)
    attention_mirror_pages: int = 0
    # prefill steps: True (`--prefill-attention-gate`), the output gate in the attention kernel's epilogue
    # (attention_prefill's GATE render); False (the default: PREFILL_ATTENTION_GATE_CHOICE), the attention, then the
    # sigmoid_gate kernel
    prefill_attention_gate: bool = False
    # template constants pinned by `--set TEMPLATE.CONSTANT=VALUE` (`codegen.overrides`): {} for the default renders
    template_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    # decode steps: weights prefetched into L2 beside the latency-bound ops, up to this many MB per op
    # (`codegen.prefetch`, `--l2-prefetch-mb`; 0: off)
    l2_prefetch_mb: int = 0

    def nvfp4_relayouts(self) -> list[dict[str, Any]]:
        """The MoE layers whose six NVFP4 expert params the runtime re-lays out at load time (`moe_nvfp4_decode`'s
        `relayout`: codes int32 [E, N, K/8], block scales uint8 [E, N, K/16], global scales unchanged): those read by
        a `moe_nvfp4_decode` launch (its fast path) and otherwise only by launches that read that layout too
        (`moe_nvfp4_decode`, `moe_nvfp4_prefill` without NATIVE_FP4), in every step. Not on sm100 for a bf16 model,
        whose prefill path (NATIVE_FP4, tl.dot_scaled) reads the ModelOpt bytes, nor where no decode kernel is emitted. One entry
        per layer: {"layer", "params" (the six names, IR order), "kernel" (the decode kernel whose module's
        `relayout` transforms them)}."""
        if not self.nvfp4_relayout:
            return []
        readers: dict[str, list[Launch]] = {}
        groups: dict[tuple[str, ...], dict[str, Any]] = {}
        for st in self.steps.values():
            for node, ln in st.launches:
                for v in named_params(node, ln):
                    readers.setdefault(v.producer.attrs["name"], []).append(ln)
                if node.op == "moe_experts" and ln.kernel is not None and ln.kernel.template == "moe_nvfp4_decode":
                    ps = node.inputs[2:8]
                    if all(v.producer is not None and v.producer.op == "param" for v in ps):
                        names = tuple(v.producer.attrs["name"] for v in ps)
                        groups.setdefault(names, {"layer": node.layer, "params": list(names),
                                                  "kernel": ln.kernel.name})

        def reads_relaid(ln: Launch) -> bool:
            k = ln.kernel
            return k is not None and (k.template in ("moe_nvfp4_decode", "moe_nvfp4_frag") or (
                k.template == "moe_nvfp4_prefill" and not k.constants.get("NATIVE_FP4")))

        return [g for names, g in groups.items() if all(reads_relaid(ln) for n in names for ln in readers[n])]

    def load_transforms(self) -> dict[str, Any]:
        """The manifest's `load_transforms`: op -> what the runtime does to its weights at load time ({} if none)."""
        plan = self.nvfp4_relayouts()
        if not plan:
            return {}
        return {"moe_experts": {
            "transform": RELAYOUT,
            "what": "each MoE layer's NVFP4 experts re-laid out once, layer by layer: codes int32 [E, N, K/8], block "
                    "scales uint8 [E, N, K/16] (the layout of moe_nvfp4_decode's RELAYOUT), global scales unchanged; "
                    "moe_nvfp4_decode (decode steps to emitters.MOE_DECODE_MAX_TOKENS; moe_nvfp4_frag up to "
                    "--moe-frag-max-tokens) and moe_nvfp4_prefill (above) all read that one copy",
            "function": sorted({f"kernels/{g['kernel']}.py: relayout" for g in plan}),
            "layers": [g["layer"] for g in plan],
            "params": [n for g in plan for n in g["params"]]}}

    def manifest(self) -> dict[str, Any]:
        spec_json = self.spec.model_dump_json()
        relaid = {g["params"][i] for g in self.nvfp4_relayouts() for i in (0, 1, 3, 4)}  # (global scales kept)
        uses: dict[str, dict[str, Any]] = {}
        library: dict[str, dict[str, Any]] = {}
        for st in self.steps.values():
            for node, ln in st.launches:
                if ln.kernel is None:
                    entry = library.setdefault(ln.library, {"pending": ln.pending, "ops": set(), "launches": {}})
                    entry["ops"].add(node.op)
                    entry["launches"][st.phase] = entry["launches"].get(st.phase, 0) + 1
                    if ln.condition():
                        entry.setdefault("when", {})[node.op] = ln.condition()
                    continue
                u = uses.setdefault(ln.kernel.name, {"phases": {}, "example": None})
                u["phases"][st.phase] = u["phases"].get(st.phase, 0) + 1
                if ln.condition():
                    u["when"] = ln.condition()
                if ln.choice is not None:
                    u["choice"] = ln.choice
                if u["example"] is None:
                    u["example"] = _io_record(node, ln, st.graph, relaid)
        kernels = {}
        for name, k in self.kernels.items():
            kernels[name] = {"template": f"{k.template}.py.j2", "op": k.op, "constants": k.constants,
                             "grid": _grid_rule(k), "launches_per_step": uses[name]["phases"],
                             **({"runs_when": uses[name]["when"]} if "when" in uses[name] else {}),
                             **({"choice": uses[name]["choice"]} if "choice" in uses[name] else {}),
                             **uses[name]["example"], "measured_on_hardware": MEASURED[self.target]}
        return {
            "spec": {"name": self.spec.name, "sha256": hashlib.sha256(spec_json.encode()).hexdigest()},
            "target": self.target, "arch": f"sm_{TARGETS[self.target]}a", "tp": self.tp, "rank": self.rank,
            "passes": self.passes,
            "dtypes": self.spec.dtypes.model_dump(),
            "compute_dtype": self.dtype, "page_size": self.page_size,
            "kernels": kernels,
            "library_calls": {k: {**v, "ops": sorted(v["ops"])} for k, v in library.items()},
            "steps": {p: {"launches": len(st.launches), "scratch": _scratch(st)} for p, st in self.steps.items()},
            "nvfp4_relayout": self.nvfp4_relayout,
            "moe_dequant": self.moe_dequant,
            "moe_wgmma": self.moe_wgmma,
            "moe_combine_max_tokens": self.moe_combine_max_tokens,
            "moe_frag_max_tokens": self.moe_frag_max_tokens,
            "attention_mirror_pages": self.attention_mirror_pages,
            "prefill_attention_gate": {"fused": self.prefill_attention_gate, **PREFILL_ATTENTION_GATE_CHOICE},
            "template_overrides": self.template_overrides,
            "l2_prefetch_mb": self.l2_prefetch_mb,
            "load_transforms": self.load_transforms(),
        }

    def write(self, out_dir: str | Path) -> Path:
        out = ensure_dir(out_dir, "-o")
        kdir = ensure_dir(out / "kernels", "-o")
        for old in kdir.glob("*.py"):  # a previous package's kernels must not linger beside this one's
            old.unlink()
        (kdir / "__init__.py").write_text("")
        for name, k in self.kernels.items():
            (kdir / f"{name}.py").write_text(k.source())
        (out / "__init__.py").write_text(f'"""beamc package of {self.spec.name} for {self.target}, TP rank '
                                         f'{self.rank} of {self.tp}."""\n')
        (out / "step.py").write_text(render_steps(self))
        (out / "spec.json").write_text(self.spec.model_dump_json(indent=1) + "\n")  # the package is self-contained
        (out / "manifest.json").write_text(json.dumps(self.manifest(), indent=1, default=_jsonable) + "\n")
        return out


def _jsonable(x):
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


def _io_record(node, ln: Launch, g: Graph, relaid: set[str] = frozenset()) -> dict[str, Any]:
    """What one launch reads and writes, with the weights and their load-time layout (`relaid`: the params the
    runtime re-lays out, see `Package.nvfp4_relayouts`)."""
    vals = {v.name: v for v in node.inputs + node.outputs}
    params = {v.name: v.producer for v in node.inputs if v.producer is not None and v.producer.op == "param"}
    if ln.kernel is not None and ln.kernel.template == "l2_prefetch":  # (a schedule hint: its args are later ops')
        return {"args": [{"name": a} for a in ln.args], "weights": [],
                "example_node": {"layer": node.layer, "op": node.op, "prefetch_before": True}}
    return {
        "args": [{"name": a, "shape": list(vals[a].shape), "dtype": vals[a].dtype} if a in vals else {"name": a}
                 for a in ln.args],
        "weights": [{"param": p.attrs["name"], "shape": list(p.out.shape), "dtype": p.out.dtype,
                     "layout": ({"packed_from": p.attrs["pack"], "dim": p.attrs["dim"]} if "pack" in p.attrs
                                else RELAYOUT + " at load" if p.attrs["name"] in relaid
                                else "as stored (this rank's slice)")} for p in params.values()],
        "example_node": {"layer": node.layer, "op": node.op},
    }


def _grid_rule(k: KernelSpec) -> str:
    """The template's GRID line (read from the rendered text: no import needed)."""
    for line in k.source().splitlines():
        if line.startswith("GRID"):
            return line.split("=", 1)[1].strip().strip("\"'")
    return "see the launcher"


def _scratch(st: Step) -> list[dict[str, Any]]:
    """The step's scratch buffers, one per role."""
    out: dict[str, dict[str, Any]] = {}
    for _, ln in st.launches:
        for n, s, d in ln.scratch:
            out.setdefault(n, {"name": n, "shape": list(s), "dtype": d})
    return list(out.values())


def render_steps(pkg: Package) -> str:
    """step.py: per phase, a function that issues every launch in graph order over a dict of buffers."""
    from beamc.codegen.kernel import render

    phases = []
    for phase, st in pkg.steps.items():
        lines, last_layer = [], object()
        for node, ln in st.launches:
            if node.layer != last_layer:
                last_layer = node.layer
                kind = layer_kind(pkg.spec, node.layer) if node.layer is not None else "embedding / head"
                lines.append(f"    # ---- layer {node.layer} ({kind})" if node.layer is not None else f"    # ---- {kind}")
            args = ", ".join([f"v[{a!r}]" for a in ln.args] + [f"{k}={v!r}" for k, v in ln.kwargs])
            cond = ln.condition()
            pre = f"    if {cond}: " if cond else "    "
            if ln.kernel is not None:
                lines.append(f"{pre}K[{ln.kernel.name!r}].launch({args})  # {node.op}")
            else:
                lines.append(f"{pre}L.{ln.library}({args})  # {node.op}: library call ({ln.pending})")
        tokens = next(n for n in ("input_ids", "positions") if n in st.graph.leaves("input"))
        lines.insert(0, f"    T = v[{tokens!r}].shape[0]  # this step's tokens (fixed per CUDA-graph bucket)")
        phases.append({"name": phase, "body": "\n".join(lines), "launches": len(st.launches)})
    return render("step", spec_name=pkg.spec.name, target=pkg.target, tp=pkg.tp, rank=pkg.rank,
                  passes=pkg.passes, kernels=sorted(pkg.kernels), phases=phases, DTYPE="")


# the bf16 mirror's scratch (K and V) that `auto_mirror_pages` allows at most: 512 MiB (at TP 8 it holds 8 sequences of
# the full spec's 104,448 positions: 428 MB)
MIRROR_AUTO_BYTES = 512 << 20
MIRROR_AUTO_SEQUENCES = 8


def auto_mirror_pages(spec: ModelSpec, graph) -> int:
    """The default of `--attention-mirror` (auto): 0 without a paged fp8 cache (the option does nothing there);
    else pages for MIRROR_AUTO_SEQUENCES sequences of the spec's max_position_embeddings, at most MIRROR_AUTO_BYTES
    of mirror (H200 2026-12-01 s8run2: the full layer's prefill of 8 x 2,048 tokens over 100K 23.2 -> 14.7 ms, the
    TP-8 prefill step 626 -> 542 ms; sequences without room read the cache as before; the mirrored pass has tiles of
    its own, so its softmax sums run in another order than the plain render's)."""
    pools = [n for n in graph.leaves("state").values() if n.out.shape[0] == "P" and n.out.dtype == "f8e4m3"]
    if not pools:
        return 0
    _, page, hkv, dim = pools[0].out.shape
    per_page = 2 * page * hkv * dim * 2  # K and V, bf16
    want = MIRROR_AUTO_SEQUENCES * -(-spec.max_position_embeddings // page)
    return max(1, min(want, MIRROR_AUTO_BYTES // per_page))


# The attention_gate pass's op in prefill steps: the gate in the attention kernel's epilogue, or the attention then
# the sigmoid_gate kernel (the same roundings: bitwise equal on the H200, tests/gpu/test_kernels_attention_*_gpu.py).
# Measured in the whole TP-8 prefill step (8 x 2,048 tokens over 102,400 of context) on the H200, 2026-12-01:
PREFILL_ATTENTION_GATE_CHOICE = {
    "basis": "measured", "fused_ms": 460.98, "two_launches_ms": 456.85,
    "also": "the ablation's rows fold_small -> attention_gate: prefill 452.4 -> 459.3 ms",
    "source": "bench/results/variants-2026-12-01-s12run7.json, ablation-2026-12-01.json"}


# decode steps' L2 prefetch budget per latency-bound op (`codegen.prefetch`): off, measured without gain in the step
# (H200, 2026-12-01: TP-8 decode 2.821 ms with 24 MB against 2.811 / 2.804 without; docs/perf-log.md)
L2_PREFETCH_MB = 0


def compile_package(spec: ModelSpec, *, target: str = "sm90", tp: int = 1, rank: int = 0,
                    passes: list[str] | tuple[str, ...] = (), dtype: str | None = None,
                    phases: tuple[str, ...] = ("decode", "prefill"), pdl: bool = True,
                    nvfp4_relayout: bool = True, moe_dequant: bool = True, moe_wgmma: bool = True,
                    attention_mirror_pages: int | None = None, moe_combine_max_tokens: int | None = None,
                    prefill_attention_gate: bool = False, moe_frag_max_tokens: int = 0,
                    template_overrides: dict[str, dict[str, Any]] | None = None, l2_prefetch_mb: int | None = None,
                    overrides_from: str = "--set") -> Package:
    """Spec -> one rank's generated package (in memory; `.write(dir)` puts it on disk). `pdl`: kernels with
    Programmatic Dependent Launch (on by default: the H200 run of 2026-11-30 gave the same bits with and without it
    and 0.3-0.6 us less per kernel; fp32 instances never have it: the CPU interpreter has no PDL).
    `nvfp4_relayout`: the runtime re-lays out the NVFP4 experts at load for the sm90 MoE kernels (on by default: see
    `Package.nvfp4_relayout`); recorded in the manifest. `moe_dequant`: prefills of many tokens take the MoE render
    that dequantises the gate_up weights once per step (`emitters.MOE_DEQUANT_MIN_TOKENS`); recorded likewise.
    `moe_wgmma`: sm90 prefills of many tokens take the MoE render on wgmma instead (`emitters.MOE_WGMMA_CHOICE`;
    it needs the relayout); recorded likewise.
    `moe_combine_max_tokens`: up to this many tokens the MoE decode kernel combines the top-k in its down epilogue (at
    TP > 1, the combine_experts pass); None: `emitters.MOE_COMBINE_MAX_TOKENS`; recorded likewise.
    `attention_mirror_pages` > 0: full-attention prefill over fp8 caches through a bf16 mirror of that many pages
    (attention_prefill's MIRROR), 0: off, None (the default): `auto_mirror_pages`; recorded likewise.
    `template_overrides` ({template: {constant: value}}, `--set`): pinned in every kernel rendered from that template
    (`codegen.overrides`: each must name a template and a constant it reads, and some kernel of the package must be
    rendered from it; `overrides_from` names where they came from in errors); recorded likewise.
    `prefill_attention_gate`: prefill steps run an attention_gate op as the attention kernel's GATE render (True) or
    as the attention then the sigmoid_gate kernel (False, the default: PREFILL_ATTENTION_GATE_CHOICE); decode steps
    always fuse; recorded likewise. `moe_frag_max_tokens`: steps of up to this many tokens (at most the COMBINE range)
    run a moe_experts with `combine` as the moe_nvfp4_frag kernel where it applies (sm90, bf16, the relayout on:
    `emitters.MOE_FRAG_CHOICE`; 0: off); recorded likewise. `l2_prefetch_mb`: decode steps prefetch the weights of the
    launches after each latency-bound op into L2 while it runs, up to this many MB each (`codegen.prefetch`; 0: off;
    None: L2_PREFETCH_MB); recorded likewise."""
    template_overrides = validate_overrides(template_overrides, overrides_from)
    if target not in TARGETS:
        raise BeamcError("--target", f"unknown target {target!r}", "use sm90 (Hopper) or sm100 (Blackwell)")
    compiled = compile_spec(spec, tp=tp, ranks=[rank], passes=passes, phases=phases, dtype=dtype, logits="last")
    if attention_mirror_pages is not None and attention_mirror_pages < 0:
        raise BeamcError("--attention-mirror", f"{attention_mirror_pages} pages",
                         "give a page count >= 0 (0: off) or auto")
    if attention_mirror_pages is None:
        attention_mirror_pages = auto_mirror_pages(spec, compiled.graphs[phases[0]][0])
    if moe_frag_max_tokens < 0:
        raise BeamcError("--moe-frag-max-tokens", f"{moe_frag_max_tokens} tokens", "give a count >= 0 (0: off)")
    if moe_combine_max_tokens is not None and moe_combine_max_tokens < 0:
        raise BeamcError("--moe-combine-max-tokens", f"{moe_combine_max_tokens} tokens", "give a count >= 0 (0: off)")
    ctx = Context(target=target, dtype=dtype or compiled.graphs[phases[0]][0].meta["dtype"], pdl=pdl,
                  moe_dequant=moe_dequant, moe_wgmma=moe_wgmma, attention_mirror_pages=attention_mirror_pages,
                  moe_combine_max_tokens=moe_combine_max_tokens, prefill_attention_gate=prefill_attention_gate,
                  nvfp4_relayout=nvfp4_relayout, moe_frag_max_tokens=moe_frag_max_tokens,
                  template_overrides=template_overrides, overrides_from=overrides_from)
    if l2_prefetch_mb is None:
        l2_prefetch_mb = L2_PREFETCH_MB
    if l2_prefetch_mb < 0:
        raise BeamcError("--l2-prefetch-mb", f"{l2_prefetch_mb} MB", "give a budget >= 0 (0: off)")
    steps, kernels = {}, {}
    for phase in phases:
        g = compiled.graphs[phase][0]
        st = Step(phase, g)
        for node in g.nodes:
            if OPS[node.op].leaf:
                continue
            for ln in launches(node, g, ctx):
                if ln.library == "view":  # free: a view of its input, nothing to launch
                    continue
                st.launches.append((node, ln))
        if phase == "decode" and ctx.dtype != "f32":  # (the CPU interpreter's fp32 packages have no L2 to fill)
            st.launches = prefetch_plan(st.launches, g, l2_prefetch_mb, template_overrides.get("l2_prefetch"),
                                        overrides_from)
        for _, ln in st.launches:
            if ln.kernel is not None:
                kernels.setdefault(ln.kernel.name, ln.kernel)
        steps[phase] = st
    idle = unused_overrides(template_overrides, {k.template for k in kernels.values()})
    if idle:
        raise BeamcError(f"{overrides_from} " + ", ".join(idle), "no kernel of this package is rendered from "
                         + ("these templates" if len(idle) > 1 else "this template"),
                         "override a template the package uses (the manifest's kernels name theirs)")
    assert (TEMPLATES / "step.py.j2").exists()
    pools = [n.out.shape for n in steps[phases[0]].graph.leaves("state").values() if n.out.shape[0] == "P"]
    return Package(spec, target, tp, rank, list(passes), steps, kernels, dtype=ctx.dtype,
                   page_size=pools[0][1] if pools else None, nvfp4_relayout=nvfp4_relayout, moe_dequant=moe_dequant,
                   moe_wgmma=moe_wgmma,
                   attention_mirror_pages=attention_mirror_pages, moe_combine_max_tokens=moe_combine_max_tokens,
                   prefill_attention_gate=prefill_attention_gate, moe_frag_max_tokens=moe_frag_max_tokens,
                   template_overrides=template_overrides, l2_prefetch_mb=l2_prefetch_mb)
