"""Every kernel of the full spec's TP-8 sm90 package (and the MoE prefill's WGMMA render, off by default) compiled
ahead of time with the H200's Triton version (3.6), not this machine's: the CPU tests compile with whatever Triton is
installed here, and a compiler crash that only the device's version has (the 2026-11-30 run 7: Triton 3.6's
TritonGPUOptimizeDotOperands on the re-laid-out prefill MoE kernel) would otherwise first show on the device.

Opt-in (minutes on 2 cores): install the device's Triton beside this one and point BEAMC_DEVICE_TRITON at it,
    pip install --no-deps --target /tmp/t36 triton==3.6.0
    BEAMC_DEVICE_TRITON=/tmp/t36 python -m pytest tests/test_device_triton.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

DEVICE_TRITON = os.environ.get("BEAMC_DEVICE_TRITON")
pytestmark = pytest.mark.skipif(not DEVICE_TRITON, reason="set BEAMC_DEVICE_TRITON to a site dir holding the "
                                "device's Triton (pip install --no-deps --target DIR triton==3.6.0)")

CHILD = r"""
import json, sys, tempfile, traceback
import triton
from beamc.codegen.kernel import aot_compile, launch_options, load_kernel
from beamc.codegen.package import compile_package
from beamc.passes.manager import PASSES
from beamc.spec import load_spec
spec = load_spec(sys.argv[1])
pkg = compile_package(spec, tp=8, rank=0, passes=list(PASSES))
# the MoE prefill's WGMMA render (--set moe_nvfp4_prefill.WGMMA=true: off by default, its Gluon kernel included)
wg = compile_package(spec, tp=8, rank=0, passes=list(PASSES), template_overrides={"moe_nvfp4_prefill": {"WGMMA": True}})
kernels = dict(pkg.kernels, **{n + "+wgmma": k for n, k in wg.kernels.items() if k.constants.get("WGMMA")})
d = tempfile.mkdtemp()
out = {"triton": triton.__version__, "failed": {}, "compiled": []}
for name, k in sorted(kernels.items()):
    variants = [("", None)]
    if k.template == "moe_nvfp4_prefill":
        variants.append(("+relaid", True))
    if k.template in ("gemv", "moe_router"):  # T = 1 has its own path (one pass / one launch)
        variants.append(("+T1", "T1"))
    for tag, relaid in variants:
        mod = load_kernel(k, d)
        if relaid == "T1":
            mod.CONSTEXPRS = dict(mod.constexprs(1), **({"INTERPRET": False} if "INTERPRET" in mod.CONSTEXPRS else {}))
        elif relaid:
            mod.SIGNATURE, mod.CONSTEXPRS = mod.SIGNATURE_RELAID, dict(mod.CONSTEXPRS, RELAID=True)
        try:
            for i, options in enumerate(launch_options(mod)):  # each binary the launcher launches
                aot_compile(mod, 90, options)
                out["compiled"].append(name + tag + (f"+options{i}" if i else ""))
        except Exception:
            out["failed"][name + tag] = traceback.format_exc().splitlines()[-1][:300]
print(json.dumps(out))
"""


def test_every_tp8_kernel_compiles_with_the_device_triton():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([DEVICE_TRITON, str(ROOT)]))
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "models/beam.yaml")], env=env, capture_output=True,
                       text=True, timeout=3600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["triton"] != "" and out["compiled"] and not out["failed"], out
