"""Bench tools for kernel engineers, without a GPU: bench/variants.py (template variants in the whole step: what its
command line accepts and the table it prints; its run path is bench/ablation.py's `run_row`, exercised on the tiny
spec by `--dry`), bench/attention_decode.py's `--ncu-qkn` launcher, bench/launch_floor.py's and
bench/broadcast_read.py's `--dry`."""
from __future__ import annotations

import pytest

from conftest import load_bench_module

variants = load_bench_module("variants")


def test_a_variant_is_a_label_and_checked_overrides():
    label, over, opts = variants.parse_variant("w8=attention_decode.NUM_WARPS=8,attention_decode.KV_TILES=true")
    assert label == "w8" and over == {"attention_decode": {"NUM_WARPS": 8, "KV_TILES": True}} and opts == {}
    assert variants.parse_variant("ungated=compile.prefill_attention_gate=false") == (
        "ungated", {}, {"prefill_attention_gate": False})
    assert variants.parse_variant("unfused=pass.qk_attention=false,attention_decode.NUM_WARPS=8") == (
        "unfused", {"attention_decode": {"NUM_WARPS": 8}}, {"disable": ["qk_attention"]})  # (a pass left out)
    assert variants.parse_variant("l4=form.bm256.WG_LOAD_WARPS=4,form.bm256.WG_LOAD_REGS=96") == (
        "l4", {}, {"forms": {"bm256": {"WG_LOAD_WARPS": 4, "WG_LOAD_REGS": 96}}})  # (a key of the emitter's form)
    for bad in ("attention_decode.NUM_WARPS=8", "w8", "w8=attention_decode.WARPS=8", "w8=nothing.X=1",
                "x=pass.nothing=false", "x=pass.qk_attention=true", "x=form.bm512.WG_AQ=true", "x=form.bm256.WG_AQ=",
                "x=form.bm256.wg_aq=true",
                "x=compile.passes=none", "x=compile.moe_dequant=", "x=compile.prefill_attention_gate=maybe",
                "x=compile.moe_combine_max_tokens=true", "x=compile.attention_mirror_pages=2.5"):
        with pytest.raises(SystemExit):
            variants.parse_variant(bad)


def test_a_form_change_holds_while_its_variant_compiles_only():
    from beamc.codegen import emitters
    before = {k: dict(v) for k, v in emitters.MOE_WGMMA_FORMS.items()}
    with variants.emitter_forms({"bm256": {"WG_LOAD_WARPS": 4}}):
        assert emitters.MOE_WGMMA_FORMS["bm256"]["WG_LOAD_WARPS"] == 4
        assert emitters.MOE_WGMMA_FORMS["bm128"] == before["bm128"]
    assert emitters.MOE_WGMMA_FORMS == before


def test_the_table_sets_each_variant_against_the_two_default_runs():
    rows = [{"label": "default", "overrides": {}, "decode": {"ms": 2.0}},
            {"label": "w8", "overrides": {"attention_decode": {"NUM_WARPS": 8}}, "decode": {"ms": 2.2}},
            {"label": "bad", "overrides": {"gemv": {"SMS": 1}}, "error": "RuntimeError: boom"},
            {"label": "ungated", "overrides": {}, "options": {"prefill_attention_gate": False},
             "decode": {"ms": 1.9}, "prefill": {"ms": 450.0}},
            {"label": "default (again)", "overrides": {}, "decode": {"ms": 2.0}}]
    rows[1]["decode"]["logits"] = {"bitwise_equal": False, "max_abs_diff": 0.0123, "finite": True}
    rows[3]["decode"]["logits"] = {"bitwise_equal": True, "max_abs_diff": 0.0, "finite": True}
    t = variants.table({"rows": rows})
    assert "| w8 | attention_decode.NUM_WARPS=8 | 2.200 | +10.0% | - | max diff 0.012 |" in t
    assert "failed: RuntimeError: boom" in t and "2.000 and 2.000 ms" in t
    assert "| ungated | compile.prefill_attention_gate=False | 1.900 | -5.0% | 450.00 | bitwise |" in t
    assert "| default | - | 2.000 | +0.0% | - | - |" in t  # (rows from before the comparison: no cell)


def test_rounds_alternate_each_variant_with_the_default_and_pair_them():
    """--rounds: a variant and the default timed once per round each, the default first in even rounds, the variant
    first in odd ones; the paired figure is the median and range of its ms over the default's in the same round;
    the table shows it (the default's own row has none)."""
    import torch

    order = []
    base, var = (None, lambda: order.append("d")), (None, lambda: order.append("v"))
    b, v = variants.alternated(base, var, torch.device("cpu"), steps=2, rounds=3)
    assert order == ["d", "d", "v", "v", "v", "v", "d", "d", "d", "d", "v", "v"]
    assert len(b) == len(v) == 3
    rows = [{"label": "default", "overrides": {}, "decode": {"ms": 2.0}},
            {"label": "s0_3", "overrides": {"moe_nvfp4_decode": {"STAGES0": 3}},
             "decode": {"ms": 1.9, "rounds_ms": [1.9, 2.2, 2.1 * 0.97], "rounds_base_ms": [2.0, 2.2, 2.1]}},
            {"label": "bad", "overrides": {}, "error": "RuntimeError: boom"},
            {"label": "default (again)", "overrides": {},
             "decode": {"ms": 2.1, "rounds_ms": [2.02, 2.2, 2.1], "rounds_base_ms": [2.0, 2.2, 2.1]}}]
    variants.paired(rows)
    q = rows[1]["decode"]["paired"]
    assert q["median"] == pytest.approx(0.97) and q["min"] == pytest.approx(0.95) and q["max"] == pytest.approx(1.0)
    assert "paired" not in rows[0]["decode"] and "paired" not in rows[2]
    t = variants.table({"rows": rows})
    assert "| s0_3 | moe_nvfp4_decode.STAGES0=3 | 1.900 | -7.3% | - | - | -3.00% [-5.00%, +0.00%] |" in t
    assert "| default (again) | - | 2.100 | +2.4% | - | - | +0.00% [+0.00%, +1.00%] |" in t
    assert "| default | - | 2.000 | -2.4% | - | - | - |" in t
    assert "paired vs default" in t and "the noise left" in t


def test_logits_are_compared_step_by_step_with_the_defaults():
    import torch

    ref = [torch.randn(1, 50), torch.randn(1, 50)]
    same = variants.compare_logits([r.clone() for r in ref], ref)
    assert same == {"bitwise_equal": True, "max_abs_diff": 0.0, "finite": True}
    moved = [ref[0].clone(), ref[1] + 0.5]
    moved[1][0, 3] = float("nan")
    c = variants.compare_logits(moved, ref)
    assert not c["bitwise_equal"] and not c["finite"]
    assert variants.compare_logits(ref[:1], ref)["max_abs_diff"] is None  # a step missing: not comparable


_NCU_QKN = """
import json, sys
sys.argv = ["x"]
sys.path.insert(0, "bench")
import attention_decode as ad
runs = [ad.qkn_ncu_launches("sliding", "f8e4m3", 600, reps=1, device="cpu"),
        ad.qkn_ncu_launches("full", "bf16", 300, reps=1, device="cpu", overrides={"attention_decode": {"NUM_WARPS": 2}})]
json.dump(runs, open(OUT, "w"))
"""


def test_attention_bench_launches_the_steps_qkn_render_for_ncu(tmp_path):
    """`bench/attention_decode.py --ncu-qkn KIND:KV:CONTEXT`: the qk_attention kernel exactly as the compiler emits it
    at TP 8 (template overrides too), launched on one token with every output written (CPU interpreter here)."""
    from conftest import run_interpreted

    out = tmp_path / "ncu.json"
    runs = run_interpreted(["-c", _NCU_QKN.replace("OUT", repr(str(out)))], out)
    sliding, full = runs
    assert sliding["constants"]["QKN"] and sliding["constants"]["WINDOW"] == 512 and sliding["splits"] == 16
    assert sliding["constants"]["MODE"] == "rope" and sliding["constants"]["CACHE_DTYPE"] == "f8e4m3"
    assert full["constants"]["PAGED"] and full["constants"]["MODE"] == "ssmax" and full["constants"]["NUM_WARPS"] == 2


def _dry_run(script: str, out_dir, pattern: str) -> tuple[str, list[dict]]:
    """bench/<script> --dry --out out_dir under the Triton interpreter (a child process): its stdout and the rows of
    the one JSON matching `pattern` that it wrote."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "bench" / script), "--dry", "--out", str(out_dir)],
                       env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (out,) = Path(out_dir).glob(pattern)
    return r.stdout, json.loads(out.read_text())["rows"]


def test_launch_floor_dry_runs_its_chains_under_the_interpreter(tmp_path):
    """bench/launch_floor.py --dry: every row's chain of launches run once under the Triton interpreter (the
    dependency each launch reads from the one before checked), the JSON and the table written."""
    stdout, rows = _dry_run("launch_floor.py", tmp_path, "launch-floor-*-dry.json")
    assert len(rows) == 10 and {x["programs"] for x in rows} == {1, 132, 264, 528}
    assert "| 528 x 4 warps, PDL last |" in stdout


def test_broadcast_read_dry_runs_its_cases_under_the_interpreter(tmp_path):
    """bench/broadcast_read.py --dry: each mode (the broadcast after its writer, read-only, distinct buffers) run
    under the Triton interpreter with every program's sum checked, the JSON and the table written."""
    stdout, rows = _dry_run("broadcast_read.py", tmp_path, "broadcast-read-*-dry.json")
    assert [x["mode"] for x in rows] == ["after-write", "read-only", "distinct"]
    assert "| bytes | programs | mode | us | TB/s delivered |" in stdout
