"""bench/prefill_gemms.py's routes on the CPU (its --dry run): every route writes every output, and the other routes
give the step's route's values (the unaligned one bit for bit on the CPU: the same GEMM without the zero rows)."""
import sys

import pytest
import torch

from conftest import load_bench_module

prefill_gemms = load_bench_module("prefill_gemms")  # (bench/ not left on sys.path: see load_bench_module)


@pytest.mark.parametrize("splits", [prefill_gemms.SPLITS, prefill_gemms.SPLITS_PER_HEAD_GATE])
def test_the_qkvg_routes_write_the_step_routes_values(splits):
    routes = prefill_gemms.qkvg_routes(48, "cpu", splits)
    for name, (fn, outs, _) in routes.items():
        for o in outs:
            o.fill_(float("nan"))
        fn()
        assert all(torch.isfinite(o).all() for o in outs), name
    step = routes["step"][1]
    assert [o.shape[1] for o in step] == list(splits)
    assert all(torch.equal(a, b) for a, b in zip(routes["unaligned"][1], step))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(routes["aligned+gate"][1], step))


def test_the_dry_run_writes_its_record(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["prefill_gemms.py", "--dry", "--out", str(tmp_path)])
    assert prefill_gemms.main() == 0
    assert len(list(tmp_path.glob("prefill-gemms-*-dry.json"))) == 1
