#!/usr/bin/env bash
# Per-instruction (SASS) stall profiles of the kernels that hold the steps, for reading on the CPU afterwards:
#   decode attention, full layer at 100K context (the step's QKN render, fp8 cache): stage 0 + merge
#   MoE experts at one token (re-laid out): stage 0 + stage 1; moe-frag / moe-frag-cp: moe_nvfp4_frag's, default and
#   the cp.async render
#   the router's prefill GEMM at 16,384 tokens: both launches
#   moe-wgmma: moe_nvfp4_prefill's WGMMA render at 16,384 tokens in the emitter's form there (emitters.MOE_WGMMA_FORMS
#   bm256), its two Gluon launches (`wg_kernel`: stages 3, 4)
#   attn-wgmma / attn-mirror: the full layer's mirrored prefill attention (8 x 2,048 over 100K, fp8 cache), the
#   WGMMA render's Gluon pass / the Triton pass (stage 2)
#   attn-sliding: a sliding layer's prefill pass (8 x 2,048 over 100K, fp8 ring, F16_DOT, the emitter's sliding tile)
#   attn-sliding-wgmma: the same layer's pass on the ring mirror with the WGMMA render (off in the emitter)
# Each: ncu with WarpStateStats + SourceCounters (+ SpeedOfLight, Occupancy, LaunchStats) into $OUT/NAME.ncu-rep, then
# the report's source page as SASS with per-instruction samples ($OUT/NAME-sass.csv) and its details page (text).
#   PYTHONPATH=... bash bench/ncu_source.sh [qkn moe router]    # on the H200; OUT defaults to /tmp/ncu
# Clocks left as they are (--clock-control none: METHOD.md).
set -u
out=${OUT:-/tmp/ncu}
mkdir -p "$out"
prof() {  # NAME LAUNCH_COUNT CMD...  (kre=REGEX: the kernels' names, by default ^kernel$)
  local name=$1 count=$2
  shift 2
  echo "== $name: $*"
  ncu --clock-control none --kernel-name "regex:${kre:-^kernel\$}" --launch-skip 2 --launch-count "$count" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SourceCounters --import-source yes -f -o "$out/$name" "$@" > "$out/$name.log" 2>&1
  echo "   rc $? ($(tail -1 "$out/$name.log"))"
  ncu -i "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/$name-sass.csv" 2>> "$out/$name.log"
  ncu -i "$out/$name.ncu-rep" --page details > "$out/$name-details.txt" 2>> "$out/$name.log"
  wc -l "$out/$name-sass.csv" "$out/$name-details.txt" | head -2
}
for what in "${@:-qkn moe router}"; do
  for w in $what; do
    case $w in
      qkn) prof qkn-full-100k 2 python3 bench/attention_decode.py --ncu-qkn full:f8e4m3:100000 ;;
      qkn-sliding) prof qkn-sliding-4k 2 python3 bench/attention_decode.py --ncu-qkn sliding:f8e4m3:4096 ;;
      moe) prof moe-decode-t1 2 python3 bench/moe_decode.py --ncu --tokens 1 ;;
      moe-frag) prof moe-frag-t1 2 python3 bench/moe_frag_bench.py --ncu --tokens 1 ;;
      moe-frag-cp) prof moe-frag-cp-t1 2 python3 bench/moe_frag_bench.py --ncu --tokens 1 --variants "cp.async g5 r96" ;;
      router) prof router-prefill-16k 2 python3 bench/router_prefill.py --ncu --tokens 16384 ;;
      moe-wgmma) kre='^wg_kernel$' prof moe-wgmma-16k 2 \
                   python3 bench/moe_prefill.py --tokens 16384 --ncu "$(python3 -c 'import json
from beamc.codegen.emitters import moe_wgmma_form
print(json.dumps(moe_wgmma_form("bm256")))')" ;;  # (the emitter's 256-row form as it is now, its GEMM stages)
      attn-wgmma) kre='^wg_attention$' prof attn-wgmma-100k 1 python3 bench/attention_prefill.py --out /tmp/ncu-x \
                    --tiles "[$(python3 -c 'import json
from beamc.codegen.emitters import ATTENTION_WGMMA_TILES
print(json.dumps(dict(MIRROR=True, **ATTENTION_WGMMA_TILES)))')]" ;;  # (the emitter's full-layer pass)
      attn-sliding) prof attn-sliding-100k 1 python3 bench/attention_prefill.py --out /tmp/ncu-x \
                      --cases sliding:f8e4m3:100000 --tiles "[$(python3 -c 'import json
from beamc.codegen.emitters import ATTENTION_SLIDING_PREFILL_TILES
print(json.dumps(dict(F16_DOT=True, **ATTENTION_SLIDING_PREFILL_TILES)))')]" ;;  # (the sliding layers' pass)
      attn-sliding-wgmma) kre='^wg_attention$' prof attn-sliding-wgmma-100k 1 python3 bench/attention_prefill.py \
                            --out /tmp/ncu-x --cases sliding:f8e4m3:100000 --tiles "[$(python3 -c 'import json
from beamc.codegen.emitters import ATTENTION_WGMMA_TILES
print(json.dumps(dict(MIRROR=True, **ATTENTION_WGMMA_TILES)))')]" ;;  # (the ring mirror's WGMMA pass: off in the emitter)
      attn-mirror) prof attn-mirror-100k 1 python3 bench/attention_prefill.py --out /tmp/ncu-x \
                     --tiles '[{"MIRROR": true}]' ;;  # (launch 3 of `kernel`: the first launch's stage 2)
      *) echo "unknown profile $w" ;;
    esac
  done
done
