"""Shared fixtures: the tiny spec, random tiny checkpoints (written once per session), transformers' Beam loaded
from them, and a transformers attention function that runs beamc's attention reference."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    try:  # transformers' per-tensor loading bars would bury the test output
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_spec():
    from beamc.spec import load_spec

    return load_spec(ROOT / "models/beam-tiny.yaml")


@pytest.fixture(scope="session")
def tiny_spec_bf16(tiny_spec):
    """The tiny spec with bf16 experts: the form transformers loads without a quantizer."""
    from beamc.checkpoint.init import with_experts

    return with_experts(tiny_spec, "bf16")


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_spec_bf16, tmp_path_factory) -> Path:
    """Random tiny checkpoint with bf16 experts (loadable by transformers as is)."""
    from beamc.checkpoint.init import init_weights

    d = tmp_path_factory.mktemp("tiny_bf16")
    init_weights(tiny_spec_bf16, d, seed=1234)
    return d


@pytest.fixture(scope="session")
def tiny_ckpt_nvfp4(tiny_spec, tmp_path_factory) -> Path:
    from beamc.checkpoint.init import init_weights

    d = tmp_path_factory.mktemp("tiny_nvfp4")
    init_weights(tiny_spec, d, seed=99, experts="nvfp4")
    return d


def register_beamc_attention() -> str:
    """Register beamc's attention reference as a transformers attention implementation, so that a bf16 comparison
    isolates everything else: with it, transformers and the interpreter run identical attention arithmetic."""
    from transformers import AttentionInterface

    from beamc.ir.reference import attention_ref

    def beamc_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, sliding_window=None, **kw):
        assert query.shape[0] == 1, "one unpadded sequence per call"
        S = query.shape[2]
        q = query[0].transpose(0, 1).contiguous()  # [S, heads, d]
        kc = key[0].transpose(0, 1).contiguous()[None]  # a one-slot cache holding positions 0..S-1
        vc = value[0].transpose(0, 1).contiguous()[None]
        pos = torch.arange(S, device=query.device)
        out = attention_ref(q, kc, vc, torch.zeros_like(pos), pos, window=sliding_window, scale=scaling)
        return out[None], None

    AttentionInterface.register("beamc_ref", beamc_attention)
    return "beamc_ref"


def run_interpreted(argv: list[str], out: Path, env: dict | None = None) -> dict:
    """`python argv...` in a process of its own with TRITON_INTERPRET=1 (Triton's CPU interpreter patches
    triton.language and imports parts of triton lazily: it must not share a process with compiled kernels), `env`
    added to its environment; returns the JSON the child wrote to `out`."""
    import json
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, *argv], env={**os.environ, "TRITON_INTERPRET": "1", **(env or {})}, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(Path(out).read_text())


def interpret_cases(out: str, cases, check) -> None:
    """In the interpreter's child process: `check(name)` for every case name, each result (a dict) or the traceback
    of its failure recorded under the name (`error`), written to `out` as JSON for the tests of each case."""
    import json
    import os
    import traceback

    assert os.environ.get("TRITON_INTERPRET") == "1"
    results = {}
    for name in cases:
        try:
            results[name] = check(name)
        except Exception:  # noqa: BLE001 - reported by the test of that case
            results[name] = dict(error=traceback.format_exc())
    Path(out).write_text(json.dumps(results))


def run_interpreted_main(module: str, out: Path, env: dict | None = None) -> dict:
    """run_interpreted for a test module that has `_interpreted_main(out)`."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); "
            f"import {module} as t; t._interpreted_main({str(out)!r})")
    return run_interpreted(["-c", code], out, env)


def loaded_local_bytes(fn) -> list[int]:
    """Local memory a thread of each binary a Triton kernel has loaded on the GPU (the driver's LOCAL_SIZE_BYTES,
    which Triton keeps as n_spills = bytes / 4)."""
    out = []
    for cache in fn.device_caches.values():
        for ck in cache[0].values():
            ck._init_handles()
            out.append(4 * ck.n_spills)
    return out


def write_gpu_summary(summary: dict, name: str):
    """Generator for a module fixture: stamp the versions and device into `summary`, let the tests fill it, then
    write it to $BEAMC_GPU_OUT/<name> when that is set (the device tool brings $OUT back)."""
    import json
    import os

    import triton

    summary["env"] = dict(torch=torch.__version__, triton=triton.__version__,
                          device=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    yield summary
    out = os.environ.get("BEAMC_GPU_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_text(json.dumps(summary, indent=1))


def assert_template_contract(mod) -> None:
    """The contract of beamc/codegen/kernel.py for a rendered module rendered with PDL on: every kernel argument
    typed in SIGNATURE, in order; constexprs as CONSTEXPRS; one OPTIONS dict that the launcher launches with (and
    LAUNCH_OPTIONS, where it launches with others too)."""
    import inspect

    assert list(mod.SIGNATURE) == mod.kernel.arg_names  # every kernel argument typed, in order
    assert {n for n, t in mod.SIGNATURE.items() if t == "constexpr"} == set(mod.CONSTEXPRS)
    assert all(t in ("i32", "constexpr") or t.startswith("*") for t in mod.SIGNATURE.values())
    opts = {k: v for k, v in mod.OPTIONS.items() if k != "num_stages"}  # (a template's own pipeline depth)
    assert opts == dict(num_warps=mod.NUM_WARPS, enable_fp_fusion=False, enable_reflect_ftz=False,
                        launch_pdl=True) and mod.PDL is True
    assert mod.OPTIONS.get("num_stages", getattr(mod, "NUM_STAGES", 3)) == getattr(mod, "NUM_STAGES", 3)
    # (the launcher, and the one it calls where it launches a part of its stages: moe_nvfp4_prefill's launch_stages)
    launch_src = "".join(inspect.getsource(f) for f in (mod.launch, getattr(mod, "launch_stages", None)) if f)
    assert "num_warps=" not in launch_src and "enable_fp_fusion" not in launch_src
    # other option sets the launcher launches with (LAUNCH_OPTIONS: the router's one-warp selection, the MoE prefill's
    # per-stage binaries) differ from OPTIONS in their warps and pinned constants (of the kernel's) only
    from beamc.codegen.kernel import launch_options

    sets = launch_options(mod)
    assert sets[0] == mod.OPTIONS
    assert all(dict(o, num_warps=0, constexprs=0, fn=0) == dict(mod.OPTIONS, num_warps=0, constexprs=0, fn=0)
               for o in sets)
    assert all(set(o.get("constexprs", {})) <= set(mod.CONSTEXPRS) for o in sets if "fn" not in o)
    # (a set naming a second kernel of the module: its own signature, every constant of it pinned in the set)
    assert all(set(mod.SIGNATURES[o["fn"]]) >= set(o["constexprs"]) for o in sets if "fn" in o)
    # (a launcher that picks an option set per launch, from LAUNCH_OPTIONS or per stage from STAGE_OPTIONS)
    assert "**OPTIONS)" in launch_src or ((len(sets) > 1 or hasattr(mod, "STAGE_OPTIONS")) and "**opts)" in launch_src)


def hf_model(ckpt: Path, dtype: torch.dtype, attn: str = "sdpa"):
    from transformers import BeamForCausalLM

    model = BeamForCausalLM.from_pretrained(ckpt, dtype=dtype, attn_implementation=attn,
                                            experts_implementation="eager")
    return model.eval()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def captured_graph(fn, reps: int = 1) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of `reps` calls of fn(), after one warm-up call (compilation, autotuning) on a side stream, as
    capture requires; not yet replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph


def graph_us(fn, reps: int = 50) -> float:
    """µs per fn() call: `reps` calls captured in one CUDA graph (`captured_graph`), replayed 5 times, the median."""
    graph = captured_graph(fn, reps)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return sorted(times)[2]


class routing_margins:
    """Within the block, every moe_select / moe_router the interpreter runs appends its per-token routing margin
    (beamc.ir.reference.moe_select_margin) to `self.calls`; `per_row()` is the smallest over the calls, per token
    row. Near-ties (margin ~1e-7) are where an fp32 kernel may legitimately route differently from the reference."""

    def __enter__(self):
        import torch.nn.functional as F
        from beamc.ir import reference as R

        self.calls, self._saved = [], {k: R.REFS[k] for k in ("moe_select", "moe_router")}

        def select(logits, bias, a):
            self.calls.append(R.moe_select_margin(logits, bias, a))
            return R.moe_select_ref(logits, bias, a)
        R.REFS["moe_select"] = lambda t, a: select(t[0], t[1], a)
        R.REFS["moe_router"] = lambda t, a: select(F.linear(t[0].float(), t[1].float()), t[2], a)
        return self

    def __exit__(self, *exc):
        from beamc.ir import reference as R

        R.REFS.update(self._saved)

    def per_row(self) -> torch.Tensor:
        return torch.stack([c.cpu() for c in self.calls]).min(dim=0)[0]


def spec_variant(spec, changes: dict):
    """The spec with nested fields changed ({"attention.sliding.window": 5, ...}), validated like a spec file."""
    from beamc.spec import parse_spec

    data = spec.model_dump()
    for path, value in changes.items():
        node = data
        *parents, last = path.split(".")
        for k in parents:
            node = node[k]
        node[last] = value
    return parse_spec(data)


def load_bench_module(name: str):
    """bench/<name>.py as a module, without leaving bench/ (kernels.py, gemm.py, ...) on sys.path: the bench scripts
    put it there for their sibling imports, and in this process it would shadow installed packages of the same
    names (transformers >= 5.25 imports the `kernels` package when it is installed, and found bench/kernels.py)."""
    import importlib.util
    import sys

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        saved = list(sys.path)
        try:
            spec.loader.exec_module(mod)
        finally:
            sys.path[:] = saved
    return sys.modules[name]
