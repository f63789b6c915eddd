"""bench/qk_norm_prefill.py's --dry run (Triton's CPU interpreter, in a child process): every variant's outputs equal
the reference variant's bit for bit (TOKENS: the one-token render's code per token), and the record is written."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_dry_run_gives_every_variant_the_same_bits(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "bench/qk_norm_prefill.py"), "--dry", "--out", str(tmp_path),
                        "--prior", "1000", "--tiles", '[{"TOKENS": 1}, {"TOKENS": 3}, {"TOKENS": 8, "NUM_WARPS": 2}, {}]'],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (record,) = tmp_path.glob("qk-norm-prefill-*.json")
    records = json.loads(record.read_text())["records"]
    assert len(records) == 8 and all(x["bitwise"] for x in records), records
    # ({}: the step's own constants, emitters.QK_NORM_PREFILL_TILES's 2 tokens a program)
    assert [x["tokens_a_program"] for x in records[:4]] == [1, 3, 8, 2]
