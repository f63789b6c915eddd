#!/usr/bin/env bash
# The next device calls, by name: each one `run` call (carry [".wheels"]), at most ~9 of its 10 minutes, everything
# under $OUT, a short summary last. The plan and its reasons: docs/perf-log.md, the latest "Next (for the ... session)".
#   bash bench/device_plan.sh attn           # WGMMA prefill attention: GPU tests, then the tile sweep
#   bash bench/device_plan.sh sliding        # the sliding layers' ring MIRROR + WGMMA: GPU tests, then timings
#   bash bench/device_plan.sh combo          # sliding's tests and timings, the runtime's WGMMA attention, the prefill step
#   bash bench/device_plan.sh moe-prefill    # WG_V16 and the 128-row default form: GPU tests, then 8,192 / 2,048 tokens
#   bash bench/device_plan.sh moe-half       # WG_HALF: the experts' last blocks on fewer MMA rows: tests, timings
#   bash bench/device_plan.sh half-step      # ... and the prefill step with it
#   bash bench/device_plan.sh w4aq           # stage 3's 4-step ring slots (whole sectors) and WG_AQ: tests, timings
#   bash bench/device_plan.sh forms          # the emitter's new forms: graph replay, runtime test, the step with / without WG_AQ
#   bash bench/device_plan.sh parts2         # stage 3's two load partitions on alternate runs, stage 4's store
#                                            # partition (256-row form): tests, timings
#   bash bench/device_plan.sh wtma           # stage 3's words by TMA boxes: GPU tests, then timings
#   bash bench/device_plan.sh wtma-step      # ... the prefill step with them (and WG_ALATE)
#   bash bench/device_plan.sh slide-tiles    # the sliding layers' Triton prefill pass at other tiles
#   bash bench/device_plan.sh tma2           # WG_WTMA with WG_ATMA / with the A partition: timings, GPU cases
#   bash bench/device_plan.sh atma-step      # the prefill step with WG_ATMA (and WG_NOFENCE4) in the 256-row form
#   bash bench/device_plan.sh atma4          # stage 3's A partition beside stage 4's TMA rows: timings, tests, step
#   bash bench/device_plan.sh emitter35      # the emitter's s35 256-row form: runtime test, odd shapes, graph replay
#   bash bench/device_plan.sh qkvg           # the prefill QKV+gate GEMM (N 1,030) against aligned routes
#   bash bench/device_plan.sh s36            # emitter35 + qkvg + the 256-row forms' timings, one call
#   bash bench/device_plan.sh s39            # (ran as s39run1: TRIP_HELPERS, since removed; its call now runs s39c's)
#   bash bench/device_plan.sh s39b           # (ran as s39run2: ONE_LOOP, since removed; its call now runs s39c's)
#   bash bench/device_plan.sh s39c           # the sliding prefill on 4 warps (the emitter's): GPU cases, tiles, the step
#   bash bench/device_plan.sh s39d           # ... with EX2_FTZ: GPU cases, the pass's ncu, the step against 8 warps without
#   bash bench/device_plan.sh s39e           # Q16_OUT (q's fp16 tile as a shared-memory wgmma operand): GPU cases, tiles
#   bash bench/device_plan.sh s39f           # the sliding step tile (4 warps, EX2_FTZ, Q16_OUT): GPU cases, runtime, the step
#   bash bench/device_plan.sh s39g           # why the ring mirror's WGMMA pass is slow at ~10 blocks a tile: spans, ncu
#   bash bench/device_plan.sh s39h           # a MIRROR pass's programs skip the other pass's rows before q: cases, spans
#   bash bench/device_plan.sh s41a           # the MoE sort's RANK_SORT: GPU cases, the sort's timings; the router's BLOCK_M
#   bash bench/device_plan.sh s41b           # the prefill step with RANK_SORT (and the router's BLOCK_M)
#   bash bench/device_plan.sh s41c           # the MoE layer with RANK_SORT in the emitter's forms
#   bash bench/device_plan.sh s41d           # the new defaults' GPU cases, the step's profile by op
#   bash bench/device_plan.sh s41e           # the 128-row MoE form with SORT_ALONE: timings
#   bash bench/device_plan.sh s42a           # what bounds the 256-row MoE form's stages: WG_DIAG variants' stage times
#   bash bench/device_plan.sh s42b           # WG_WTMA4 (stage 4's words by TMA): GPU cases, timings, and s42a's
#   bash bench/device_plan.sh s44a           # the decode MoE's bytes read alone (the 8 us target's floor), then s43a's
#                                            # timings and 3 of COMBINE's GPU cases (~9.5 minutes)
#   bash bench/device_plan.sh s44b           # TMA_KV (decode attention's pages by TMA boxes): sweep, GPU cases, the step
#   bash bench/device_plan.sh s44c           # the three deciding timings in one call: COMBINE, WG_PINGPONG, TMA_KV (+ read floor)
#   bash bench/device_plan.sh s47a           # the runtime's inputs by pinned asynchronous copies: its GPU cases, the API's
#                                            # host cost against the path before (bench/api_overhead.py)
#   bash bench/device_plan.sh s47b           # decode by batch size (1-64) at 100K: ms, tokens/s, bytes, by op
#   bash bench/device_plan.sh s47c           # decode at batch 8-64 with the MoE on the grouped kernel above 8 tokens
#   bash bench/device_plan.sh s47d           # the MoE decode kernel alone at 16 / 64 tokens: stages apart, occupancy variants
#   bash bench/device_plan.sh s47e           # MAXNREG 128 (the plain MoE decode render): GPU cases, decode at batch 16 / 64
#   bash bench/device_plan.sh s48a           # batch decode's MoE: wider programs, the idx scan, PLAN (alone, GPU
#                                            # cases), the step at batch 16 / 64 with PLAN
#   bash bench/device_plan.sh s48b           # the attention's split rule at batch 16 / 64; the runtime's graph decode
#   bash bench/device_plan.sh s48c           # PLAN and TARGET_PROGRAMS 528 the defaults: GPU cases, decode at batch 1-64
#   bash bench/device_plan.sh s48d           # s48c's failed steps again
#   bash bench/device_plan.sh s48e           # the planned MoE decode kernel at 64-256 tokens against the grouped kernel
#   bash bench/device_plan.sh s48f           # s48e, then decode at batch 128 with the MoE decode kernel up to 128 tokens
#   bash bench/device_plan.sh s49a           # the MoE at 2-8 tokens: the planned plain render + combine against COMBINE
#   bash bench/device_plan.sh s49b           # the full layers' decode attention at batch 16 / 64: configs x splits
#   bash bench/device_plan.sh s49c           # decode at batch 1-8 / 64 / 128: the default, then every candidate at once
#   bash bench/device_plan.sh s49d           # the kernels behind s49c, and the decode attention at batch 64
#   bash bench/device_plan.sh s49e / s49f    # s49c cut for little device time (+ attention / router; 4 batches)
#   bash bench/device_plan.sh s49g / s49h    # s49d cut to ~4 / ~2.5 minutes
#   bash bench/device_plan.sh s49i           # the grouped prefill kernel at 64-256 tokens (s49d's other side)
#   bash bench/device_plan.sh s46a           # COMBINE's GPU cases, the prefill step with COMBINE beside the default
#   bash bench/device_plan.sh s46b           # COMBINE the default: its forms' GPU cases, the steps' profile by op
#   bash bench/device_plan.sh s46c           # the sliding layers' decode key blocks of 64 / 128 in the decode step
#   bash bench/device_plan.sh s46d           # s46c cut to blocks of 64 only (~4.5 minutes)
#   bash bench/device_plan.sh s44d           # the prefill step with COMBINE / WG_PINGPONG; WG_PINGPONG's GPU cases
#   bash bench/device_plan.sh s44e           # the decode step with TMA_KV; TMA_KV's and COMBINE's GPU cases
#   bash bench/device_plan.sh s44f           # s44c cut to ~6.5 minutes (no read floor, 3 TMA configs)
#   bash bench/device_plan.sh s44g           # ~4.5 minutes: COMBINE's and TMA_KV's timings only
#   bash bench/device_plan.sh s44h           # s44g with TMA_KV's timing first
#   bash bench/device_plan.sh s43a           # COMBINE (the prefill MoE's y in the sort's order + its own combine):
#                                            # GPU cases, timings beside the route before; WG_PINGPONG's timing
#   bash bench/device_plan.sh s43c           # s43a cut to ~6 minutes: COMBINE's timings, 4 GPU cases
#   bash bench/device_plan.sh s43d           # s43b cut: COMBINE in the prefill step only
#   bash bench/device_plan.sh s43e           # COMBINE's timings only (~3 minutes)
#   bash bench/device_plan.sh s43b           # COMBINE in the prefill step; WG_PINGPONG's GPU cases
#   bash bench/device_plan.sh s42d           # WG_PINGPONG (the full layer's partitions' MMAs in turn): timings, cases
#   bash bench/device_plan.sh s42e           # ... cut to ~4 minutes: one timing each, one GPU case
#   bash bench/device_plan.sh s42c           # WG_WTMA4's GPU cases, WG_YSTREAM (y's stores evict-first): cases, timings
#   bash bench/device_plan.sh s40            # qk_norm_pos_kv's TOKENS / NUM_WARPS: GPU cases, prefill timings, the step
#   bash bench/device_plan.sh s38f           # the copy stage by mirror page: GPU cases, the runtime, kernels at 9 / 257 rows
#   bash bench/device_plan.sh s38e           # the plan's atomics: GPU cases, kernels at 9 / 257 rows
#   bash bench/device_plan.sh s38d           # TILE_ORDER's ranking in the copy stage: GPU cases, kernels, the step
#   bash bench/device_plan.sh s38c           # the full / sliding layers' kernels (profiler), the sliding pass's ncu
#   bash bench/device_plan.sh s38            # TILE_ORDER in the prefill step (paired), its runtime GPU tests, the attention's ncu
#   bash bench/device_plan.sh s37            # the prefill router's GPU tests and timings, the MoE's SORT_ALONE (~9 min)
#   bash bench/device_plan.sh s36b           # the aligned QKV+gate route + BF16X3: runtime GPU tests, routes, the step
#   bash bench/device_plan.sh router36       # the prefill router's BF16X3 render: GPU tests and timings (~6 minutes)
#   bash bench/device_plan.sh regs256        # the 256-row form's store / A partitions on fewer registers: timings
#   bash bench/device_plan.sh fence          # bench/fence_probe.py (the fence's wait on copies in flight), the WG_WTMA
#                                            # GPU tests, then timings with the WTMA and regs256 forms
#   bash bench/device_plan.sh moe-ncu        # the WGMMA MoE's stall profile per SASS instruction (ncu)
#   bash bench/device_plan.sh persist        # the one-launch decode MoE: its GPU kernel tests and runtime test
#   bash bench/device_plan.sh persist-step   # ... its forms in the decode step, paired
#   bash bench/device_plan.sh runtime        # the prefill step with / without the WGMMA MoE and attention (both default)
#   bash bench/device_plan.sh decode-knobs   # --set options never measured in the decode step (boundary warps, ...)
# Each step has its own time limit (a kernel never run before that hangs costs its limit, not the call). Everything
# under $OUT comes back as one archive, plan-out.tgz (a call returns at most 8 files).
set -uo pipefail
: "${OUT:?set OUT (the device tool sets it)}"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .wheels/*.whl
export PYTHONPATH=/tmp/site:$PWD
# variants.py --rounds keeps the default package loaded beside each variant's: the H200's 141 GB hold both, an
# H100's 80 GB do not (s32run3: out of memory), so there the variants run one after another, unpaired
ROUNDS=$(python3 -c "import torch; print(4 if torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 0)" \
         2>/dev/null || echo 0)
summary=()

step() {  # LABEL SECONDS CMD...: run with a time limit, log to $OUT/LABEL.log, remember its last lines
  local label=$1 secs=$2
  shift 2
  echo "== $label ($secs s): $*"
  local t0=$SECONDS
  timeout -s KILL "$secs" "$@" > "$OUT/$label.log" 2>&1
  local rc=$?
  summary+=("$label: rc $rc, $((SECONDS - t0)) s")
  tail -25 "$OUT/$label.log"
}

pingpong_tiles() {  # the emitter's full-layer attention form, and the same with WG_PINGPONG (bench/attention_prefill.py --tiles)
  python3 -c 'import json
from beamc.codegen.emitters import ATTENTION_WGMMA_TILES
a = dict(MIRROR=True, **ATTENTION_WGMMA_TILES)
print(json.dumps([a, dict(a, WG_PINGPONG=True)]))'
}

tests() {  # LABEL SECONDS PYTEST_ARGS...: one gpu_run.sh pytest run (pytest itself killed 15 s before the step)
  local label=$1 secs=$2
  shift 2
  step "$label" "$secs" env PYTEST_LOG="$label-pytest" PYTEST_TIMEOUT=$((secs - 15)) bash bench/gpu_run.sh "$@"
}

case "${1:?name a call: attn, sliding, combo, moe-prefill, moe-half, moe-half-lean, load8s3, w4aq, forms, parts2, regs256, fence, tma2, atma-step, atma4, atma4-step, emitter35, qkvg, s36, s36b, s37, s37b, s37c, s37d, s38, s38c, s38d, s38e, s38f, s39, s39b, s39c, s39d, s39e, s39f, s39g, s39h, s40, s40b, s40c, s40d, s41a, s41b, s41c, s41d, s41e, s42a, s42b, s42c, s42d, s42e, s47a, s47b, s47c, s47d, s47e, s48a, s48b, s48c, s48d, s48e, s48f, s49a, s49b, s49c, s49d, s49e, s49f, s49g, s49h, s49i, s50a, s50b, s50c, s50d, s50e, s52a, s46a, s46b, s46c, s46d, s44a, s44b, s44c, s44d, s44e, s44f, s44g, s44h, s43a, s43b, s43c, s43d, s43e, ncu37, s37-lite, router36, wtma, wtma-step, slide-tiles, half-step, moe-ncu, persist, persist-step, runtime, decode-knobs}" in
  attn)
    tests t-attn 200 tests/gpu/test_kernels_attention_prefill_gpu.py -k "wgmma or ex2"
    step attn-sweep 170 python3 bench/attention_prefill.py --out "$OUT" --tiles '[{"MIRROR": true}, {"MIRROR": true, "WGMMA": true}, {"MIRROR": true, "WGMMA": true, "WG_SPLIT": true}, {"MIRROR": true, "WGMMA": true, "WG_STAGES": 2}, {"MIRROR": true, "WGMMA": true, "WG_STAGES": 3}, {"MIRROR": true, "WGMMA": true, "WG_SPLIT": true, "WG_STAGES": 6}, {"MIRROR": true, "EX2_FTZ": true}, {"MIRROR": true, "GATE": true}, {"MIRROR": true, "WGMMA": true, "GATE": true}]'
    ;;
  sliding)  # the sliding layers' ring MIRROR and its WGMMA pass (window mask): GPU tests (full ones too), then timings
    tests t-slide 300 tests/gpu/test_kernels_attention_prefill_gpu.py -k "mirror or wgmma"
    step slide-sweep 240 python3 bench/attention_prefill.py --out "$OUT" --cases sliding:f8e4m3:100000,sliding:f8e4m3:0,full:f8e4m3:100000 --tiles '[{"F16_DOT": true}, {"MIRROR": true}, {"MIRROR": true, "WGMMA": true}, {"MIRROR": true, "WGMMA": true, "WG_SPLIT": true}, {"MIRROR": true, "WGMMA": true, "WG_SPLIT": true, "BLOCK_N": 128, "WG_STAGES": 2}]'
    ;;
  combo)  # one call when machines are scarce: the sliding layers' GPU tests and timings, the runtime test of the
    # mirrored WGMMA attention (both layer kinds), and the prefill step with / without it
    tests t-slide 150 tests/gpu/test_kernels_attention_prefill_gpu.py -k "sliding and (mirror or wgmma)"
    step slide-sweep 90 python3 bench/attention_prefill.py --out "$OUT" --cases sliding:f8e4m3:100000,full:f8e4m3:100000 --tiles '[{"F16_DOT": true}, {"MIRROR": true}, {"MIRROR": true, "WGMMA": true, "WG_SPLIT": true}]'
    BEAMC_RUNTIME_STEPS=300 tests t-rt 110 tests/gpu/test_runtime_gpu.py -k "fp8_mirror_prefill_on_wgmma"
    step variants-prefill 225 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s31 --variant nowga=attention_prefill.WGMMA=false
    ;;
  moe-prefill)
    tests t-wg 240 tests/gpu/test_kernels_moe_prefill_gpu.py -k "v16 or acopy-hres-wsteps2"
    step moe-prefill 190 python3 bench/moe_prefill.py --tokens 8192,2048 --out "$OUT" --only 'BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2,WG_WSTEPS=2 WG_ACOPY WG_HRES,moe_nvfp4_prefill dequant relaid$,moe_nvfp4_prefill dequant_down relaid$'
    ;;
  moe-half)  # WG_HALF (the experts' last blocks' MMAs on 64 / 128 rows): GPU tests, then against the forms without it
    tests t-half 240 tests/gpu/test_kernels_moe_prefill_gpu.py -k "half or v16-load8 or bn128-wsteps2"
    step moe-half 320 python3 bench/moe_prefill.py --tokens 16384,2048 --out "$OUT" --only 'BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16,WG_WSTEPS=2 WG_ACOPY WG_HRES WG_V16,WG_BN=128 stages=3 WG_WDEPTH=1'
    ;;
  moe-half-lean)  # the same in ~430 s when little device time is left: the WG_HALF tests of the emitter's forms' sizes
    tests t-half 150 tests/gpu/test_kernels_moe_prefill_gpu.py -k "half and (16384 or 2048 or tp8-1000)"
    step moe-half 270 python3 bench/moe_prefill.py --tokens 16384,2048 --out "$OUT" --only 'BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16,WG_WSTEPS=2 WG_ACOPY WG_HRES WG_V16,WG_BN=128 stages=3 WG_WDEPTH=1'
    ;;
  load8s3)  # stage 3's load partition on 8 warps, stage 4's on 4 (the 256-row form with WG_HALF): tests, timings
    tests t-l8 150 tests/gpu/test_kernels_moe_prefill_gpu.py -k "half-load8s3"
    step moe-l8 200 python3 bench/moe_prefill.py --tokens 16384,8192 --out "$OUT" --only 'WG_WSTEPS=2 WG_V16 WG_HALF'
    ;;
  w4aq)  # stage 3's words in ring slots of 4 K steps (whole sectors), WG_AQ (A copies as far as the MMAs read): tests, timings
    tests t-w4aq 230 tests/gpu/test_kernels_moe_prefill_gpu.py -k "wsteps4-v16-half-load8s3 or half-load8s3-aq or half-aq"
    step moe-w4aq 150 python3 bench/moe_prefill.py --tokens 16384 --out "$OUT" --only '(stage 3)'
    step moe-aq128 60 python3 bench/moe_prefill.py --tokens 2048 --out "$OUT/b128" --only 'WG_ACOPY WG_HRES WG_V16 WG_HALF'
    ;;
  forms)  # the emitter's new forms (8 load warps in stage 3, WG_AQ in the 128-row form): graph replay, the runtime's
          # WGMMA test, and the prefill step of 2 x 2,048 tokens (the 128-row form) with / without WG_AQ
    tests t-replay 170 tests/gpu/test_kernels_moe_prefill_gpu.py -k wgmma_cuda_graph_replay
    BEAMC_RUNTIME_STEPS=300 tests t-rt-wgmma 160 tests/gpu/test_runtime_gpu.py -k wgmma
    step variants-aq 240 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --batch 2 --tag=-s33-aq --variant noaq=form.bm128.WG_AQ=false
    ;;
  parts2)  # stage 3's two load partitions on alternate runs (WG_LOAD_PARTS 2, and with WG_A32), stage 4's store
           # partition in the 256-row form (WG_STORE, one buffer), its A rows by a partition of their own (WG_ACOPY):
           # tests, then timings beside the emitter's form
    # (timings first: each variant's y is checked against the baseline's there too; the bitwise tests after)
    step moe-parts2 240 python3 bench/moe_prefill.py --tokens 16384 --out "$OUT" \
      --only 'WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=8 (stage 3),WG_LOAD_PARTS=2,(regs256)'
    tests t-parts2 270 tests/gpu/test_kernels_moe_prefill_gpu.py -k "store1 or half-load8s3-acopy or load4-acopy or atma or parts2"
    ;;
  fence)  # does the load partition's fence (MEMBAR.ALL.CTA) wait for its own cp.async copies in flight? (~20 s),
          # then WG_WTMA's tests and the 16,384-token timings
    step fence-probe 60 python3 bench/fence_probe.py --out "$OUT"
    # the timings of the emitter's form beside the WTMA / ALATE and register-split forms, then the first two's GPU
    # cases (bitwise against the forms without them)
    step moe-regs256 270 python3 bench/moe_prefill.py --tokens 16384 --out "$OUT" \
      --only 'WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=8 (stage 3),(wtma),(regs256)'
    tests t-wtma 200 tests/gpu/test_kernels_moe_prefill_gpu.py -k "wtma or alate"
    ;;
  slide-tiles)  # the sliding layers' Triton prefill pass (F16_DOT, the model's) at other tiles: 2 stages (room for two
    # programs an SM), 64-row tiles on 4 warps, 32-key blocks, 256-row tiles (~10 key blocks a tile: its prologue and
    # epilogue weigh, s30run1)
    step slide-tiles 200 python3 bench/attention_prefill.py --out "$OUT" --cases sliding:f8e4m3:100000 --tiles '[{"F16_DOT": true}, {"F16_DOT": true, "NUM_STAGES": 2}, {"F16_DOT": true, "BLOCK_M": 64, "NUM_WARPS": 4}, {"F16_DOT": true, "BLOCK_M": 64, "NUM_WARPS": 4, "NUM_STAGES": 2}, {"F16_DOT": true, "BLOCK_N": 32}, {"F16_DOT": true, "BLOCK_M": 256, "NUM_WARPS": 8, "NUM_STAGES": 2}, {"F16_DOT": true, "NUM_WARPS": 4}]'
    ;;
  wtma-step)  # the prefill step (8 x 2,048 tokens over 100K) with WG_WTMA in both forms, and with WG_ALATE too
    step variants-wtma 420 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s34-wtma \
      --variant wtma=form.bm256.WG_WTMA=true,form.bm128.WG_WTMA=true \
      --variant wtma-alate=form.bm256.WG_WTMA=true,form.bm128.WG_WTMA=true,form.bm256.WG_ALATE=true
    ;;
  tma2)  # the thirty-fifth session's first call: both stages' TMA forms together (WG_WTMA + WG_ATMA), WG_WTMA beside the
    # A partition of 4 load warps: timings beside each alone (the emitter's 256-row form now has WG_WTMA), GPU cases
    step fence-probe 60 python3 bench/fence_probe.py --out "$OUT"  # (mode 6: a wgmma in flight)
    step moe-tma2 250 python3 bench/moe_prefill.py --tokens 16384 --out "$OUT" \
      --only 'WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=8 (stage 3),WG_WTMA (wtma),(wtma2),WG_ATMA (regs256),WG_LOAD_WARPS=4 WG_ACOPY WG_ACOPY_REGS=40 WG_A32 (regs256)'
    tests t-tma2 250 tests/gpu/test_kernels_moe_prefill_gpu.py -k "load8s3-atma or wtma-atma or load4-acopy-wtma"
    ;;
  atma4)  # the A partition in stage 3 only and stage 4's A rows by TMA (WG_ACOPY4 off, WG_ATMA), and stage 4's stores
    # deferred (WG_DSTORE): timings beside WG_WTMA (the emitter's form) and WG_WTMA + WG_ATMA, GPU cases (bitwise
    # against the forms without WG_ATMA / WG_DSTORE)
    step moe-atma4 150 python3 bench/moe_prefill.py --tokens 16384 --out "$OUT" \
      --only 'WG_LOAD_WARPS=8 WG_WTMA (wtma),WG_WTMA WG_ATMA (wtma2),(atma4),BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=8 WG_WTMA WG_ATMA WG_DSTORE (dstore),WG_A32 WG_WTMA WG_ACOPY4=0 WG_ATMA WG_DSTORE (dstore)'
    tests t-atma4 300 tests/gpu/test_kernels_moe_prefill_gpu.py -k "(atma4 and not nofence4) or dstore"
    ;;
  emitter35)  # the emitter's new 256-row form (s35): its odd-shape / 64-bit-offset kernel cases, its graph replay, and the
    # runtime's WGMMA prefill test with the form pinned (the tiny spec: no WG_WTMA there)
    BEAMC_RUNTIME_STEPS=300 tests t-rt35 130 tests/gpu/test_runtime_gpu.py -k "wgmma_moe and bm256"
    tests t-forms35 150 tests/gpu/test_kernels_moe_prefill_gpu.py -k "load4-acopy-atma4-dstore or dstore-a64 or emitters_forms_replay"
    ;;
  qkvg)  # the prefill step's dense GEMMs: the packed QKV+gate (N 1,030: rows not 16-byte aligned) against aligned
    # routes, beside an aligned GEMM's rate in the same run (~1 minute)
    step prefill-gemms 120 python3 bench/prefill_gemms.py --out "$OUT"
    ;;
  s36)  # the thirty-sixth session's first call (~9.5 minutes): emitter35's GPU checks of the new 256-row form, the
    # prefill QKV+gate GEMM routes, the 256-row forms' timings again (on an H200: issue 8's machine), and the
    # 128-row form with stage 4's resident h rows by TMA
    BEAMC_RUNTIME_STEPS=300 tests t-rt35 130 tests/gpu/test_runtime_gpu.py -k "wgmma_moe and bm256"
    tests t-forms35 150 tests/gpu/test_kernels_moe_prefill_gpu.py -k "load4-acopy-atma4-dstore or dstore-a64 or emitters_forms_replay"
    step prefill-gemms 90 python3 bench/prefill_gemms.py --out "$OUT"
    step moe-s36 120 python3 bench/moe_prefill.py --tokens 16384 --out "$OUT" \
      --only 'WG_LOAD_WARPS=8 WG_WTMA (wtma),WG_WTMA WG_ACOPY4=0 WG_ATMA (atma4),WG_ATMA WG_DSTORE (dstore)'
    # (the 128-row form, 2,048 - 8,191 tokens, with stage 4's resident h rows by TMA)
    tests t-bm128-atma4 90 tests/gpu/test_kernels_moe_prefill_gpu.py -k "aq-atma4"
    step moe-s36-128 80 python3 bench/moe_prefill.py --tokens 4096,2048 --out "$OUT/bm128" \
      --only 'moe_nvfp4_prefill wgmma relaid WG_WSTEPS=2 WG_ACOPY WG_HRES WG_V16 WG_HALF WG_AQ$,WG_AQ WG_ACOPY4=0 WG_ATMA (atma4)'
    ;;
  s37)  # (~9 minutes) the prefill router (BF16X3 + SPLIT_K, the defaults): its GPU tests, its timings at 512 - 16,384
    # tokens against the render without SPLIT_K; then the MoE's sort as a binary of its own (SORT_ALONE): GPU cases
    # (bitwise against the forms without it) and timings of both emitter forms with / without it
    tests t-router 150 tests/gpu/test_kernels_attn_router_gpu.py -k "any_num_warps or pdl_chain"
    for t in 512 4096 16384; do
      step router-t$t 45 python3 bench/router_prefill.py --out "$OUT/t$t" --tokens $t --only 'no-split-k'
    done
    tests t-sort 150 tests/gpu/test_kernels_moe_prefill_gpu.py -k "sort"
    step moe-sort 100 python3 bench/moe_prefill.py --tokens 16384 --out "$OUT/moe16k" \
      --only 'WG_ACOPY4=0 WG_ATMA WG_DSTORE (dstore),WG_DSTORE SORT_ALONE'
    step moe-sort-128 60 python3 bench/moe_prefill.py --tokens 2048 --out "$OUT/moe2k" \
      --only 'moe_nvfp4_prefill wgmma relaid WG_WSTEPS=2 WG_ACOPY WG_HRES WG_V16 WG_HALF WG_AQ$,WG_AQ SORT_ALONE (sort)'
    ;;
  s37b)  # SORT_ALONE's remaining GPU cases (s37run1 reached only the 16,384-token one), then the prefill step with it
    tests t-sort2 270 tests/gpu/test_kernels_moe_prefill_gpu.py -k "sort and not 16384"
    step variants-prefill 240 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s37 \
      --variant sort=moe_nvfp4_prefill.SORT_ALONE=true
    ;;
  ncu37)  # (~6 minutes) where the two compute buckets of the prefill step spend their time now: the emitter's 256-row
    # MoE form (stages 3 and 4) and the full layer's WGMMA attention pass, ncu with the memory / compute sections
    step ncu 540 env OUT="$OUT" bash bench/ncu_source.sh "moe-wgmma attn-wgmma"
    ;;
  s37c)  # (~8 minutes) WG_DPAIRS (stage 4's store chunks' pair indices loaded a K step ahead): GPU cases bitwise against
    # the emitter's form without it, its timing beside that form, then the prefill step with / without it
    tests t-dpairs 200 tests/gpu/test_kernels_moe_prefill_gpu.py -k dpairs
    step moe-dpairs 80 python3 bench/moe_prefill.py --tokens 16384 --out "$OUT/moe16k" \
      --only 'WG_DSTORE SORT_ALONE (sort),(dpairs)'
    step variants-prefill 240 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s37-dpairs \
      --variant dpairs=form.bm256.WG_DPAIRS=true
    ;;
  s37d)  # (~5 minutes) TILE_ORDER (the plan ranks the attention's token tiles by their work; ncu s37run3: the full
    # layer's WGMMA pass has its SMs active 84% of its cycles): GPU cases bitwise, then the full layer at 100K with / without
    tests t-order 140 tests/gpu/test_kernels_attention_prefill_gpu.py -k tile_order
    step attn-order 120 python3 bench/attention_prefill.py --out "$OUT" --cases full:f8e4m3:100000 \
      --tiles '[{"MIRROR": true, "WGMMA": true, "WG_SPLIT": true}, {"MIRROR": true, "WGMMA": true, "WG_SPLIT": true, "TILE_ORDER": true}]'
    ;;
  s38)  # (~9 minutes) TILE_ORDER (the default since s37) in the prefill step against the render without it, the
    # runtime's GPU tests that run it (the mirrored WGMMA prefill), and the attention's ncu with it
    BEAMC_RUNTIME_STEPS=300 tests t-rt-order 150 tests/gpu/test_runtime_gpu.py -k "mirror_prefill_on_wgmma"
    step variants-prefill 240 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s38-order \
      --variant noorder=attention_prefill.TILE_ORDER=false
    step ncu 120 env OUT="$OUT" bash bench/ncu_source.sh attn-wgmma
    ;;
  s38c)  # (~4 minutes) where the full layer's 9.4 ms go beside its pass's 8.4 under ncu (each launch's kernels,
    # torch.profiler), the sliding layer's likewise, and the sliding pass's ncu (its SM-active share: straddling tiles)
    step attn-kernels 200 python3 bench/attention_prefill.py --out "$OUT/attn" --profile \
      --cases full:f8e4m3:100000,sliding:f8e4m3:100000 --tiles "[$(python3 -c 'import json
from beamc.codegen.emitters import ATTENTION_WGMMA_TILES
print(json.dumps(dict(MIRROR=True, **ATTENTION_WGMMA_TILES)))'), {\"F16_DOT\": true}]"
    step ncu 100 env OUT="$OUT" bash bench/ncu_source.sh attn-sliding
    ;;
  s38d)  # (~7 minutes; s38run5) TILE_ORDER's ranking moved from the plan's one program into the copy stage's programs: the
    # attention GPU cases that run it (bitwise), the full layer's kernels without PDL (clean spans: the plan, the copy,
    # the passes) with / without TILE_ORDER and with a block table of 257 rows (a max_batch of 256), then the step
    tests t-order 150 tests/gpu/test_kernels_attention_prefill_gpu.py -k "tile_order or mirror_render"
    W='"MIRROR": true, "WGMMA": true, "WG_SPLIT": true'
    step attn-kernels 150 python3 bench/attention_prefill.py --out "$OUT/attn" --profile --cases full:f8e4m3:100000 \
      --tiles "[{$W, \"TILE_ORDER\": true}, {$W, \"TILE_ORDER\": true, \"PDL\": false}, {$W, \"PDL\": false}]"
    step attn-kernels-257 100 python3 bench/attention_prefill.py --out "$OUT/attn257" --profile --table-rows 257 \
      --cases full:f8e4m3:100000 --tiles "[{$W, \"TILE_ORDER\": true, \"PDL\": false}, {$W, \"PDL\": false}]"
    step variants-prefill 240 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s38-rank \
      --variant noorder=attention_prefill.TILE_ORDER=false
    ;;
  s38e)  # (~3 minutes) the plan's per-slot reduction by atomics (O(T + slots)): the attention GPU cases that run the
    # mirror (bitwise), the full layer's kernels without PDL at 9 and 257 block-table rows
    tests t-plan 150 tests/gpu/test_kernels_attention_prefill_gpu.py -k "tile_order or mirror_render or wgmma_render"
    W='"MIRROR": true, "WGMMA": true, "WG_SPLIT": true, "TILE_ORDER": true'
    for rows in 9 257; do
      step attn-kernels-$rows 90 python3 bench/attention_prefill.py --out "$OUT/attn$rows" --profile --table-rows $rows \
        --cases full:f8e4m3:100000 --tiles "[{$W}, {$W, \"PDL\": false}]"
    done
    ;;
  s38f)  # (~4 minutes) the copy stage by mirror page (a search over the slots' run starts): the attention GPU cases
    # that run the mirror (bitwise), the runtime's mirrored WGMMA prefill, the full layer's kernels at 9 / 257 rows
    tests t-copy 150 tests/gpu/test_kernels_attention_prefill_gpu.py -k "tile_order or mirror_render or wgmma_render"
    BEAMC_RUNTIME_STEPS=100 tests t-rt-copy 120 tests/gpu/test_runtime_gpu.py -k "mirror_prefill_on_wgmma"
    W='"MIRROR": true, "WGMMA": true, "WG_SPLIT": true, "TILE_ORDER": true'
    for rows in 9 257; do
      step attn-kernels-$rows 90 python3 bench/attention_prefill.py --out "$OUT/attn$rows" --profile --table-rows $rows \
        --cases full:f8e4m3:100000 --tiles "[{$W}, {$W, \"PDL\": false}]"
    done
    ;;
  s40)  # (~7 minutes) qk_norm_pos_kv at prefill sizes (~100 us a layer for ~63 MB: 5.3 ms a step): its GPU cases (the
    # render variants among them), the variants' timings, then the step with the best of them; first the router with
    # each launch's binary its own (STAGE pinned: the selection's AOT binary had 25 KB of stack a thread)
    tests t-router 120 tests/gpu/test_kernels_attn_router_gpu.py -k "reserves_no_local or bf16x3 or pdl_chain or split_k"
    # (the template before STAGE, when present: `git show 4b19e63:beamc/codegen/templates/moe_router.py.j2`)
    step router-local 90 python3 bench/router_local_memory.py --out "$OUT/local" \
      $( [ -f bench/old/moe_router_s39.py.j2 ] && echo --old bench/old/moe_router_s39.py.j2 )
    tests t-qk 150 tests/gpu/test_kernels_attn_router_gpu.py -k "qk_norm_pos_kv"
    # (run then, `{}` was the one-token render; the emitter's is 2 tokens since: s40b pins TOKENS)
    step qk-bench 120 python3 bench/qk_norm_prefill.py --out "$OUT/qk" \
      --tiles '[{}, {"TOKENS": 2}, {"TOKENS": 4}, {"NUM_WARPS": 8}, {"TOKENS": 4, "NUM_WARPS": 8}, {"NUM_WARPS": 2}, {}]'
    step variants-s40 280 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s40-qk \
      --variant t4=qk_norm_pos_kv.TOKENS=4
    ;;
  s40b)  # (~4 minutes) the emitter's prefill render of qk_norm_pos_kv (TOKENS 2, s40run1's fastest): its GPU cases,
    # its timings against 1 token and with k's tile as q's (KV_BLOCK 8: the one-token render's bits), the step
    tests t-qk 100 tests/gpu/test_kernels_attn_router_gpu.py -k "qk_norm_pos_kv"
    step qk-bench 90 python3 bench/qk_norm_prefill.py --out "$OUT/qk" \
      --tiles '[{"TOKENS": 1}, {"TOKENS": 2}, {"TOKENS": 2, "KV_BLOCK": 8}, {"TOKENS": 3}, {"TOKENS": 1}]'
    step variants-s40b 280 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s40b-qk \
      --variant t1=qk_norm_pos_kv.TOKENS=1
    ;;
  s41a)  # (~8 minutes) the MoE sort's RANK_SORT: GPU cases (the sort's rows bit for bit against the forms without it),
    # the sort's stages timed alone per variant; then s40c's router BLOCK_M timings and GPU cases
    tests t-ranksort 150 tests/gpu/test_kernels_moe_prefill_gpu.py -k "rank_sort_same_rows"
    step moe-sort 150 python3 bench/moe_sort.py --out "$OUT/sort"
    step router-m 100 python3 bench/router_prefill.py --out "$OUT/router" --only "select m2,select m4,select m8"
    tests t-router-m 100 tests/gpu/test_kernels_attn_router_gpu.py -k "block_m_bitwise"
    ;;
  s41b)  # (~6 minutes) the prefill step with the MoE sort's RANK_SORT, and with it the router's selection at BLOCK_M
    # ${S41_BM:-2} tokens a program (s41a's best)
    step variants-s41 330 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s41 \
      --variant rs=moe_nvfp4_prefill.RANK_SORT=true --variant rsbm=moe_nvfp4_prefill.RANK_SORT=true,moe_router.BLOCK_M=${S41_BM:-2}
    ;;
  s41c)  # (~4 minutes) the MoE layer with RANK_SORT in the emitter's forms (the step's single pass cannot resolve ~1%)
    step moe-ranksort 300 python3 bench/moe_prefill.py --out "$OUT/moe" --tokens 16384,2048 --only ranksort
    ;;
  s41d)  # (~7 minutes) the new defaults (RANK_SORT, the router's BLOCK_M 2 in prefill): the sort's GPU cases, the
    # emitter's MoE forms replayed, the runtime's prefill on the WGMMA MoE, the fp32 package against the interpreter;
    # then the whole step's profile by op
    tests t-defaults 260 tests/gpu/test_kernels_moe_prefill_gpu.py tests/gpu/test_runtime_gpu.py -k \
      "rank_sort_same_rows or emitters_forms_replay or prefill_with_the_wgmma_moe or fp32_compiled_equals"
    step profile 200 python3 bench/full_model.py --out "$OUT/r" --profile all
    ;;
  s42a)  # (~5 minutes) what bounds the 256-row MoE form's stages: WG_DIAG variants (parts left out, wrong outputs) at
    # 16,384 tokens, stage times each
    step moe-diag 420 python3 bench/moe_prefill.py --out "$OUT/moe" --tokens 16384 --only diag
    ;;
  s42b)  # (~6 minutes) WG_WTMA4 (stage 4's words by TMA boxes): the layer's timings beside the form without it and
    # s42a's diagnostics, then GPU cases (bitwise against the form without it)
    step moe-wtma4 330 python3 bench/moe_prefill.py --out "$OUT/moe" --tokens 16384 --only "wtma4,diag"
    tests t-wtma4 200 tests/gpu/test_kernels_moe_prefill_gpu.py -k "wtma4"
    ;;
  s42c)  # (~5 minutes) WG_WTMA4's GPU cases (bitwise against the form without it) and WG_YSTREAM's (y's stores
    # evict-first), then both in the layer's timings, twice each
    tests t-wtma4 200 tests/gpu/test_kernels_moe_prefill_gpu.py -k "wtma4"
    step moe-ystream 240 python3 bench/moe_prefill.py --out "$OUT/moe" --tokens 16384 --only "ystream"
    ;;
  s42d)  # (~6 minutes) WG_PINGPONG (the full layer's two MMA partitions issue each key block's MMAs in turn): the
    # full layer at 8 x 2,048 over 100K beside the emitter's form (twice each, per-launch kernels), then its GPU cases
    # (bitwise against WG_SPLIT alone, graph replay)
    step attn-pingpong 200 python3 bench/attention_prefill.py --out "$OUT/attn" --profile \
      --cases full:f8e4m3:100000 --tiles "$(python3 -c 'import json
from beamc.codegen.emitters import ATTENTION_WGMMA_TILES
a = dict(MIRROR=True, **ATTENTION_WGMMA_TILES)
print(json.dumps([a, dict(a, WG_PINGPONG=True), a, dict(a, WG_PINGPONG=True)]))')"
    tests t-pingpong 240 tests/gpu/test_kernels_attention_prefill_gpu.py -k "pingpong"
    ;;
  s44a)  # (~9.5 minutes) the decode MoE's bytes read alone (bench/read_floor.py: the floor under the 8 us target),
    # then s43a's timings (COMBINE beside the route before at 16,384 / 4,096 tokens, WG_PINGPONG) and 3 COMBINE cases
    step read-floor 70 python3 bench/read_floor.py --out "$OUT/floor"
    step moe-combine 160 python3 bench/moe_prefill.py --combine bm256 --tokens 16384 --out "$OUT/moe"
    step moe-combine128 75 python3 bench/moe_prefill.py --combine bm128 --tokens 4096 --out "$OUT/moe128"
    step attn-pingpong 120 python3 bench/attention_prefill.py --out "$OUT/attn" \
      --cases full:f8e4m3:100000 --tiles "$(pingpong_tiles)"
    tests t-combine 110 tests/gpu/test_kernels_moe_prefill_gpu.py -k \
      "combine_gives and (16384-distinct-bm256] or odd-wg-1000 or modelopt)"
    ;;
  s44b)  # (~9 minutes) TMA_KV (the full layers' decode K / V pages by TMA boxes, pipelined): the decode attention's
    # sweep at 100K (fp8, bf16) with its stage counts and blocks beside the default, its GPU cases, then the decode
    # step with it (paired rounds on an H200, one pass each on an H100)
    step attn-tma 200 python3 bench/attention_decode.py --out "$OUT/attn" --cases full:f8e4m3:100000,full:bf16:100000 \
      --configs default,tma,tma10,tma12,tma6,tma/bn32,tma/bn128,tma/pages,tma10/pages
    tests t-tma 130 tests/gpu/test_kernels_attention_decode_gpu.py -k "tma_kv"
    step variants-tma 200 python3 bench/variants.py --out "$OUT/r" --tag=-s44-tma --rounds "$((ROUNDS > 2 ? 2 : ROUNDS))" \
      --variant tma=attention_decode.TMA_KV=true
    ;;
  s44c)  # (~8.5 minutes: one call for the three timings that decide defaults) COMBINE beside the route before at
    # 16,384 tokens (the bench checks out bitwise between the routes), WG_PINGPONG beside the emitter's attention
    # form, TMA_KV's decode sweep at 100K fp8 (each config's error against the reference printed), the read floor
    step moe-combine 160 python3 bench/moe_prefill.py --combine bm256 --tokens 16384 --out "$OUT/moe"
    step attn-pingpong 120 python3 bench/attention_prefill.py --out "$OUT/attn" \
      --cases full:f8e4m3:100000 --tiles "$(pingpong_tiles)"
    step attn-tma 170 python3 bench/attention_decode.py --out "$OUT/attn-dec" --cases full:f8e4m3:100000 \
      --configs default,tma,tma10,tma12,tma/bn128,tma/pages,tma10/pages
    step read-floor 50 python3 bench/read_floor.py --out "$OUT/floor"
    ;;
  s47a)  # (~7 minutes) the runtime's step inputs written to pinned host buffers and copied asynchronously (no
    # synchronising copy a step; long prefill chunks planned as tensors): the graph-vs-eager ragged decode (10,000
    # steps, the host now free to run ahead of the GPU), every decode bucket, the fp32 package against the interpreter;
    # then the API's cost against its graphs' replays, the tree's input path beside the one before, one model
    tests t-runtime 250 tests/gpu/test_runtime_gpu.py -k "graph_decode_equals or every_decode_bucket or fp32_compiled_equals"
    step api 240 python3 bench/api_overhead.py --out "$OUT/r"
    ;;
  s47b)  # (~5 minutes) decode by batch size at 100K context (bench/decode_batch.py, new): every bucket 1-64 of the TP-8
    # rank's share, ms a step, tokens/s, the bytes a step reads against the run's read rate, the replay's time by op
    step batch 480 python3 bench/decode_batch.py --out "$OUT/r"
    ;;
  s47c)  # (~5 minutes) decode at batch 8-64 (100K context): the MoE experts on moe_nvfp4_decode up to 64 tokens (the
    # emitter's MOE_DECODE_MAX_TOKENS) against the grouped (sorted-by-expert) kernel from 9 tokens on (s47run3: the MoE
    # at batch 64 34.5 ms a step, 29% of its bytes' read time)
    step batch-moe64 230 python3 bench/decode_batch.py --out "$OUT/r" --batches 8,16,32,64
    step batch-moe8 230 python3 bench/decode_batch.py --out "$OUT/r" --batches 8,16,32,64 --moe-decode-max-tokens 8
    ;;
  s47d)  # (~3 minutes) moe_nvfp4_decode alone at 16 and 64 tokens (8 uniform random experts a token): its two stages
    # apart, and the variants that change programs per SM or columns per pass (s47run3-4: at batch 64 the MoE runs ~700
    # us a layer, 29% of its bytes' read time; the grouped kernel is no faster there and slower at 16-32)
    step moe-decode-t 220 python3 bench/moe_decode.py --out "$OUT/r" --tokens 16,64 \
      --variants "default,8 warps,maxnreg=128,maxnreg=96,MP=1,MP=2,STAGES0=3,no prefetch"
    ;;
  s47e)  # (~4 minutes) moe_nvfp4_decode's plain render capped at 128 registers (the emitter's now on sm90: the decode
    # steps of 9-64 tokens at TP 8): its GPU cases (bitwise the uncapped render's), the runtime's graph-vs-eager decode
    # (TP 1: every bucket on the plain render) over 1,000 steps, then decode at batch 16 / 64 with and without the cap
    tests t-cap 100 tests/gpu/test_kernels_moe_gpu.py -k register_cap
    step t-rt 75 env BEAMC_RUNTIME_STEPS=1000 PYTEST_LOG=t-rt-pytest PYTEST_TIMEOUT=65 bash bench/gpu_run.sh \
      tests/gpu/test_runtime_gpu.py -k graph_decode_equals
    step batch-cap 110 python3 bench/decode_batch.py --out "$OUT/r" --batches 16,64
    step batch-nocap 110 python3 bench/decode_batch.py --out "$OUT/r" --batches 16,64 --set moe_nvfp4_decode.MAXNREG=0
    ;;
  s48a)  # (~8 minutes) batch decode's MoE (s47: the MoE decode kernel's time follows its programs at 16-64 tokens):
    # the kernel alone at 16 / 64 tokens with wider programs, a wider idx scan, and PLAN (the pairs grouped by expert
    # by a first launch: no scan); their GPU cases (bitwise the default render's); the decode step at batch 16 / 64
    # with PLAN beside the default
    step moe-decode-wide 150 python3 bench/moe_decode.py --out "$OUT/r" --tokens 16,64 --variants \
      "default,maxnreg=128,BLOCK_I=16/maxnreg=168,RW=64/maxnreg=128,BLOCK_I=16/RW=64/maxnreg=168,IDX_CHUNK=128/maxnreg=128,IDX_CHUNK=512/maxnreg=128,PLAN,PLAN/maxnreg=128"
    tests t-wide 220 tests/gpu/test_kernels_moe_gpu.py -k register_cap
    step batch-base 120 python3 bench/decode_batch.py --out "$OUT/r" --batches 16,64
    step batch-plan 90 python3 bench/decode_batch.py --out "$OUT/r" --batches 16,64 --set moe_nvfp4_decode.PLAN=true
    ;;
  s48b)  # (~6 minutes) the attention's split target at batch 16 / 64 (4 and 8 programs an SM; s47: K / V read at
    # ~45% of the read rate with 2), then the runtime's graph-vs-eager decode with the capped MoE render (s47run6's
    # was killed at its limit on a fresh machine)
    step batch-tp528 100 python3 bench/decode_batch.py --out "$OUT/r" --batches 16,64 --set attention_decode.TARGET_PROGRAMS=528
    step batch-tp1056 100 python3 bench/decode_batch.py --out "$OUT/r" --batches 16,64 --set attention_decode.TARGET_PROGRAMS=1056
    step t-rt 150 env BEAMC_RUNTIME_STEPS=1000 PYTEST_LOG=t-rt-pytest PYTEST_TIMEOUT=140 bash bench/gpu_run.sh \
      tests/gpu/test_runtime_gpu.py -k graph_decode_equals
    ;;
  s48c)  # (~7 minutes) the new defaults (moe_nvfp4_decode PLAN, attention_decode TARGET_PROGRAMS 528): the MoE
    # decode kernel's GPU cases (PLAN's bitwise the scanning render's), the runtime's planned-vs-scanning and
    # graph-vs-eager decode; then decode at batch 1-64 with them and without (PLAN off, 264), one after the other
    tests t-moe 150 tests/gpu/test_kernels_moe_gpu.py -k "register_cap or matches or graph or timing"
    BEAMC_RUNTIME_STEPS=300 tests t-rt 150 tests/gpu/test_runtime_gpu.py -k "planned_moe or graph_decode_equals or every_decode_bucket"
    step batch-new 170 python3 bench/decode_batch.py --out "$OUT/r" --batches 1,2,4,8,16,64
    step batch-old 100 python3 bench/decode_batch.py --out "$OUT/r" --batches 1,2,4,8,16,64 \
      --set moe_nvfp4_decode.PLAN=false --set attention_decode.TARGET_PROGRAMS=264
    ;;
  s48d)  # (~5 minutes) s48c again where it failed: the MoE decode kernel's reference cases (the test read the plan as
    # h), decode at batch 1-64 with the new defaults (killed at its limit on a fresh machine) and without
    tests t-moe 90 tests/gpu/test_kernels_moe_gpu.py -k "matches"
    step batch-new 170 python3 bench/decode_batch.py --out "$OUT/r" --batches 1,2,4,8,16,64
    step batch-old 80 python3 bench/decode_batch.py --out "$OUT/r" --batches 1,2,4,8,16,64 \
      --set moe_nvfp4_decode.PLAN=false --set attention_decode.TARGET_PROGRAMS=264
    ;;
  s48e)  # (~3 minutes) where the planned MoE decode kernel stops winning: alone at 64 / 128 / 256 tokens (L2 flushed;
    # the read floor of the same bytes beside it) against the grouped prefill kernel's default render at the same
    # sizes (what steps of 65+ tokens run now: MOE_DECODE_MAX_TOKENS 64)
    step moe-decode-big 70 python3 bench/moe_decode.py --out "$OUT/r" --tokens 64,128,256 --variants "default,no PLAN"
    step moe-prefill-small 70 python3 bench/moe_prefill.py --out "$OUT/r" --tokens 64,128,256 --only 'moe_nvfp4_prefill relaid$'
    ;;
  s48f)  # (~7 minutes) s48e, then decode at batch 64 / 128 (32K contexts: 128 sequences' caches fit beside the weights)
    # with the MoE decode kernel up to 64 tokens (the emitter's: batch 128 on the grouped kernel) and up to 128; the
    # router's small-M path (decode's) against its large one at 8-64 tokens (s48run4: 42 us a layer at batch 64), alone
    # and in the step (the large path from 16 decode tokens on, beside batch128-64's step)
    step moe-decode-big 90 python3 bench/moe_decode.py --out "$OUT/r" --tokens 64,128,256 --variants "default,no PLAN"
    step moe-prefill-small 90 python3 bench/moe_prefill.py --out "$OUT/r" --tokens 64,128,256 --only 'moe_nvfp4_prefill relaid$'
    step batch128-64 130 python3 bench/decode_batch.py --out "$OUT/r" --batches 64,128 --context 32768
    step batch128-128 90 python3 bench/decode_batch.py --out "$OUT/r" --batches 64,128 --context 32768 --moe-decode-max-tokens 128
    step router-tokens 60 python3 bench/router_decode.py --out "$OUT/r" --tokens 8,16,32,64
    step batch-router16 80 python3 bench/decode_batch.py --out "$OUT/r" --batches 64,128 --context 32768 --router-large-min-tokens 16
    ;;
  s49a)  # (~5 minutes) the MoE at 2-8 tokens: the planned plain render + moe_combine (PLAN_MIN_PAIRS 0) beside the
    # COMBINE render (what 1-8 tokens run) and the scanning plain render, 8 layers a graph; then the step at batch 1-8
    # with COMBINE only at 1 token and the plan from 9 pairs, beside the default in the same call
    step moe-combine-plan 120 python3 bench/moe_combine.py --out "$OUT/r" --tokens 1,2,4,8 --planned
    step batch-default 130 python3 bench/decode_batch.py --out "$OUT/r" --batches 1,2,4,8
    step batch-plan8 110 python3 bench/decode_batch.py --out "$OUT/r" --batches 1,2,4,8 --moe-combine-max-tokens 1 --set moe_nvfp4_decode.PLAN_MIN_PAIRS=8 --set attention_decode.WHOLE_WAVES=true --gemv-min-tokens 8
    ;;
  s49b)  # (~3 minutes) the full layers' decode attention at batch 16 / 64 (100K contexts): tile configs x splits
    step attn-batch 200 python3 bench/attention_decode_batch.py --out "$OUT/r" --batches 16,64
    ;;
  s49c)  # (~9 minutes; s48f's and s49a's steps in two runs, then the attention's register cap in a third) decode at batch 1-8, 64, 128 (32K contexts): the default,
    # then every candidate at once, each on the ops of its own batches (the profile by op tells them apart): the MoE
    # decode kernel up to 128 tokens (64-128: the planned decode kernel instead of the grouped one), the router's large
    # path from 16 tokens, COMBINE at 1 token only with the plan from 9 pairs (2-8 tokens: planned plain + combine),
    # the full layers' attention splits floored to whole waves (64 / 128 tokens: 8 / 4 splits instead of 9 / 5), the
    # gemv for o_proj at 2-8 tokens (measured alone cuBLAS won from 4; in the step cuBLAS has no PDL overlap)
    step batch-default 200 python3 bench/decode_batch.py --out "$OUT/r" --batches 1,2,4,8,64,128 --context 32768
    step batch-cands 190 python3 bench/decode_batch.py --out "$OUT/r" --batches 1,2,4,8,64,128 --context 32768 --moe-decode-max-tokens 128 --router-large-min-tokens 16 --moe-combine-max-tokens 1 --set moe_nvfp4_decode.PLAN_MIN_PAIRS=8 --set attention_decode.WHOLE_WAVES=true --gemv-min-tokens 8
    # the attention's batch tiles from 16 tokens (4 programs an SM: blocks of 32 keys, 128 registers, no spill; whole
    # waves), at 64 / 128 (8: the same kernels as the default, a control)
    step batch-attn4 140 python3 bench/decode_batch.py --out "$OUT/r" --batches 8,64,128 --context 32768 --attention-batch-min-tokens 16
    for f in "$OUT"/r/decode-batch-"$(date +%F)"-*.json; do  # each candidate run against the default's, op by op
      step "compare-$(basename "$f" .json | cut -c25-)" 20 python3 bench/compare_batch.py "$OUT/r/decode-batch-$(date +%F).json" "$f"
    done
    ;;
  s50a)  # (~8.5 minutes) s49c's default run, which its 200 s could not hold on a cold kernel cache (s50run1: killed
    # with no line; the candidates' runs after it took ~80 s warm), beside s50run1's two candidate records carried in
    # bench/results; then the decode attention at batch 64, configs x splits
    step batch-default 330 python3 bench/decode_batch.py --out "$OUT/r" --batches 1,2,4,8,64,128 --context 32768
    for f in bench/results/decode-batch-2026-12-07-s50run1-*.json; do
      step "compare-$(basename "$f" .json | cut -c25-)" 20 python3 bench/compare_batch.py "$OUT/r/decode-batch-$(date +%F).json" "$f"
    done
    step attn-batch 130 python3 bench/attention_decode_batch.py --out "$OUT/r" --batches 64 --configs default,bn32,bn32/maxnreg128,bn16,w8/bn32
    ;;
  s50b)  # (~10 minutes) the new defaults (s50run1-2: the MoE decode kernel to 128 tokens, the router's large path from
    # 16, COMBINE to 4 tokens and the plan from 33 pairs, whole waves) in the step at batch 1-128 beside s50run2's
    # default; the router's two paths at 8-64 tokens; the runtime's GPU tests on them (graphs, buckets, TP 2's COMBINE)
    step batch-new 320 python3 bench/decode_batch.py --out "$OUT/r" --batches 1,2,4,6,8,16,32,64,128 --context 32768
    step compare-new 20 python3 bench/compare_batch.py bench/results/decode-batch-2026-12-07-s50run2-default.json "$OUT/r/decode-batch-$(date +%F).json"
    step router-tokens 50 python3 bench/router_decode.py --out "$OUT/r" --tokens 8,16,32,64
    tests t-rt 170 tests/gpu/test_runtime_gpu.py -k "every_decode_bucket or graph_decode_equals or planned_moe or tp2_rank_graphs or f16_model"
    ;;
  s50c)  # (~9.5 minutes; s50b cut for the device time left) the new defaults: the MoE decode kernel's GPU cases in its
    # new range (5 tokens planned, 100 / 128), the runtime's GPU tests, the step at batch 1 / 6 / 16 / 32 / 128
    tests t-moe 100 tests/gpu/test_kernels_moe_gpu.py -k "matches and (128 or 100 or 5-True)"
    tests t-rt 150 tests/gpu/test_runtime_gpu.py -k "every_decode_bucket or graph_decode_equals or planned_moe or tp2_rank_graphs or f16_model"
    step batch-new 230 python3 bench/decode_batch.py --out "$OUT/r" --batches 1,6,16,32,128 --context 32768
    step compare-new 20 python3 bench/compare_batch.py bench/results/decode-batch-2026-12-07-s50run2-default.json "$OUT/r/decode-batch-$(date +%F).json"
    step router-tokens 50 python3 bench/router_decode.py --out "$OUT/r" --tokens 4,8,16,32  # (the large path's bound)
    ;;
  s52a)  # (~6 minutes) the decode attention's GPU cases with WHOLE_WAVES the template's default (fiftieth session;
    # the step ran it, its cases had not): every default case against the fp32 reference, graph replay, batch tiles
    tests t-attn 330 tests/gpu/test_kernels_attention_decode_gpu.py -k "matches_fp32_reference or cuda_graph_replay or batch_tiles"
    ;;
  s50d)  # (~6 minutes; s50c cut to the device time left) the MoE decode kernel's GPU cases in its new range, the
    # runtime's GPU tests on the new defaults, then the step at batch 16 / 128 as time allows
    tests t-moe 90 tests/gpu/test_kernels_moe_gpu.py -k "matches and (128 or 100 or 5-True)"
    tests t-rt 120 tests/gpu/test_runtime_gpu.py -k "every_decode_bucket or graph_decode_equals or planned_moe or tp2_rank_graphs or f16_model"
    step batch-new 130 python3 bench/decode_batch.py --out "$OUT/r" --batches 16,128 --context 32768
    ;;
  s50e)  # (~3 minutes; the last of a session's device time) the MoE decode kernel's GPU cases in its new range, then
    # the runtime's graph-vs-eager and planned-MoE GPU tests on the new defaults
    tests t-moe 80 tests/gpu/test_kernels_moe_gpu.py -k "matches and (128 or 100 or 5-True)"
    tests t-rt 100 tests/gpu/test_runtime_gpu.py -k "graph_decode_equals or planned_moe or f16_model"
    ;;
  s49e)  # (~9 minutes, when little device time is left) s49c, then the decode attention at batch 64 (3 configs) and
    # the router's two paths at 8-64 tokens
    step batch-default 200 python3 bench/decode_batch.py --out "$OUT/r" --batches 1,2,4,8,64,128 --context 32768
    step batch-cands 190 python3 bench/decode_batch.py --out "$OUT/r" --batches 1,2,4,8,64,128 --context 32768 --moe-decode-max-tokens 128 --router-large-min-tokens 16 --moe-combine-max-tokens 1 --set moe_nvfp4_decode.PLAN_MIN_PAIRS=8 --set attention_decode.WHOLE_WAVES=true --gemv-min-tokens 8
    step attn-batch 90 python3 bench/attention_decode_batch.py --out "$OUT/r" --batches 64 --configs default,bn32,bn32/maxnreg128
    step router-tokens 50 python3 bench/router_decode.py --out "$OUT/r" --tokens 8,16,32,64
    ;;
  s49f)  # (~5.5 minutes) s49c at batch 2 / 8 / 64 / 128 only
    step batch-default 170 python3 bench/decode_batch.py --out "$OUT/r" --batches 2,8,64,128 --context 32768
    step batch-cands 160 python3 bench/decode_batch.py --out "$OUT/r" --batches 2,8,64,128 --context 32768 --moe-decode-max-tokens 128 --router-large-min-tokens 16 --moe-combine-max-tokens 1 --set moe_nvfp4_decode.PLAN_MIN_PAIRS=8 --set attention_decode.WHOLE_WAVES=true --gemv-min-tokens 8
    ;;
  s49g)  # (~4 minutes, the last of a session's device time) s49d's kernels cut: the decode attention at batch 64 (3
    # configs x splits incl. whole waves), the planned plain render + combine at 1-8 tokens, the router's two paths
    step attn-batch 80 python3 bench/attention_decode_batch.py --out "$OUT/r" --batches 64 --configs default,bn32,bn32/maxnreg128
    step moe-combine-plan 100 python3 bench/moe_combine.py --out "$OUT/r" --tokens 1,2,4,8 --planned
    step router-tokens 50 python3 bench/router_decode.py --out "$OUT/r" --tokens 8,16,32,64
    ;;
  s49i)  # (~1.5 minutes) the grouped prefill kernel at 64-256 tokens (s49d's moe-decode-big's other side)
    step moe-prefill-small 80 python3 bench/moe_prefill.py --out "$OUT/r" --tokens 64,128,256 --only 'moe_nvfp4_prefill relaid$'
    ;;
  s49h)  # (~2.5 minutes) the decode attention at batch 64 (2 configs x splits incl. whole waves), the router's paths
    step attn-batch 70 python3 bench/attention_decode_batch.py --out "$OUT/r" --batches 64 --configs default,bn32/maxnreg128
    step router-tokens 50 python3 bench/router_decode.py --out "$OUT/r" --tokens 8,16,32,64
    ;;
  s49d)  # (~9 minutes) the kernels behind s49c: the batch tiles' GPU cases; the decode attention at batch 64 (configs x
    # splits); the planned plain render + combine at 1-8 tokens beside COMBINE; the router's two paths at 8-64 tokens;
    # the planned MoE decode kernel at 64-256 tokens (the grouped kernel's side: moe_prefill.py's, in s49i)
    tests t-batch-tiles 150 tests/gpu/test_kernels_attention_decode_gpu.py -k batch_tiles
    step attn-batch 130 python3 bench/attention_decode_batch.py --out "$OUT/r" --batches 64 --configs default,bn32,bn32/maxnreg128,bn16,w8/bn32
    step moe-combine-plan 100 python3 bench/moe_combine.py --out "$OUT/r" --tokens 1,2,4,8 --planned
    step router-tokens 50 python3 bench/router_decode.py --out "$OUT/r" --tokens 8,16,32,64
    step moe-decode-big 90 python3 bench/moe_decode.py --out "$OUT/r" --tokens 64,128,256 --variants "default,no PLAN"
    ;;
  s46b)  # (~7 minutes) COMBINE the 256-row form's default: the emitter's forms replayed (as the experts-then-combine
    # route renders them), the sort's cases, the runtime's prefill on the WGMMA MoE, the fp32 package against the
    # interpreter; then the whole step's profile by op (the first since s41run5)
    tests t-defaults 260 tests/gpu/test_kernels_moe_prefill_gpu.py tests/gpu/test_runtime_gpu.py -k \
      "rank_sort_same_rows or emitters_forms_replay or prefill_with_the_wgmma_moe or fp32_compiled_equals"
    step profile 200 python3 bench/full_model.py --out "$OUT/r" --profile all
    ;;
  s46c)  # (~6 minutes) the sliding layers' decode key blocks of 64 and 128 (8 / 4 splits of the 512 window: half /
    # a quarter of the merge's splits; blocks of 16 measured +2.6% in s21, the merge's splits costing more than the
    # shorter blocks saved) in the decode step, beside the default (32: 16 splits), paired where the card holds two
    step variants-wbn 420 python3 bench/variants.py --out "$OUT/r" --tag=-s46-wbn --rounds "$((ROUNDS > 2 ? 2 : ROUNDS))" \
      --variant wbn64=attention_decode.WINDOW_BLOCK_N=64 --variant wbn128=attention_decode.WINDOW_BLOCK_N=128
    ;;
  s46d)  # (~4.5 minutes: s46c cut to the device time left) blocks of 64 only
    step variants-wbn 270 python3 bench/variants.py --out "$OUT/r" --tag=-s46-wbn --rounds "$((ROUNDS > 2 ? 2 : ROUNDS))" \
      --variant wbn64=attention_decode.WINDOW_BLOCK_N=64
    ;;
  s46a)  # (~8.5 minutes) COMBINE's GPU cases (bitwise against the route before), then the prefill step (8 x 2,048
    # over 100K) with COMBINE in the 256-row form beside the default (s46run1: the MoE alone 3,189 against 3,299 us)
    tests t-combine 200 tests/gpu/test_kernels_moe_prefill_gpu.py -k "combine_gives"
    step variants-prefill 300 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s46-prefill \
      --variant combine=form.bm256.COMBINE=true
    ;;
  s44d)  # (~9.5 minutes) the prefill step (8 x 2,048 over 100K) with COMBINE in the 256-row form and with
    # WG_PINGPONG in the full layers' attention, each beside the default; then WG_PINGPONG's GPU cases
    step variants-prefill 430 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s44-prefill \
      --variant combine=form.bm256.COMBINE=true --variant pp=attention_prefill.WG_PINGPONG=true
    tests t-pingpong 110 tests/gpu/test_kernels_attention_prefill_gpu.py -k "pingpong"
    ;;
  s44e)  # (~8.5 minutes) the decode step with TMA_KV beside the default; TMA_KV's and COMBINE's GPU cases
    step variants-tma 220 python3 bench/variants.py --out "$OUT/r" --tag=-s44-tma --rounds "$((ROUNDS > 2 ? 2 : ROUNDS))" \
      --variant tma=attention_decode.TMA_KV=true
    tests t-tma 140 tests/gpu/test_kernels_attention_decode_gpu.py -k "tma_kv"
    tests t-combine 110 tests/gpu/test_kernels_moe_prefill_gpu.py -k \
      "combine_gives and (16384-distinct-bm256] or odd-wg-1000 or modelopt)"
    ;;
  s44f)  # (~6.5 minutes: s44c cut to the device time left) COMBINE's timing, TMA_KV's decode sweep (3 configs),
    # WG_PINGPONG's timing
    step moe-combine 150 python3 bench/moe_prefill.py --combine bm256 --tokens 16384 --out "$OUT/moe"
    step attn-tma 110 python3 bench/attention_decode.py --out "$OUT/attn-dec" --cases full:f8e4m3:100000 \
      --configs default,tma,tma10,tma/pages
    step attn-pingpong 110 python3 bench/attention_prefill.py --out "$OUT/attn" \
      --cases full:f8e4m3:100000 --tiles "$(pingpong_tiles)"
    ;;
  s44g)  # (~4.5 minutes: the least device time) COMBINE's timing, TMA_KV's against the default at 100K fp8
    step moe-combine 150 python3 bench/moe_prefill.py --combine bm256 --tokens 16384 --out "$OUT/moe"
    step attn-tma 100 python3 bench/attention_decode.py --out "$OUT/attn-dec" --cases full:f8e4m3:100000 \
      --configs default,tma,tma/pages
    ;;
  s44h)  # (~4.5 minutes, the cheap timing first) TMA_KV against the default at 100K fp8, then COMBINE's timing
    step attn-tma 100 python3 bench/attention_decode.py --out "$OUT/attn-dec" --cases full:f8e4m3:100000 \
      --configs default,tma,tma/pages
    step moe-combine 150 python3 bench/moe_prefill.py --combine bm256 --tokens 16384 --out "$OUT/moe"
    ;;
  s43a)  # (~9.5 minutes) COMBINE (the combine_experts pass's prefill MoE: y in the sort's order, stage 4's chunks by
    # TMA box stores, the top-k combine as the module's stage 6): the 256-row form + moe_combine against COMBINE and
    # COMBINE without WG_YTMA at 16,384 tokens (twice each in turn, per-launch times), the 128-row form's at 4,096
    # tokens; WG_PINGPONG once beside the emitter's attention form (s42e's timing); then COMBINE's GPU cases (bitwise
    # against the route before)
    # (the timings first: the bench checks out bit for bit between the three routes itself)
    step moe-combine 160 python3 bench/moe_prefill.py --combine bm256 --tokens 16384 --out "$OUT/moe"
    step moe-combine128 80 python3 bench/moe_prefill.py --combine bm128 --tokens 4096 --out "$OUT/moe128"
    step attn-pingpong 130 python3 bench/attention_prefill.py --out "$OUT/attn" \
      --cases full:f8e4m3:100000 --tiles "$(pingpong_tiles)"
    tests t-combine 190 tests/gpu/test_kernels_moe_prefill_gpu.py -k "combine_gives"
    ;;
  s43c)  # (~5 minutes: s43a cut to the device time left) COMBINE's timings beside the route before, then 3 GPU cases
    step moe-combine 160 python3 bench/moe_prefill.py --combine bm256 --tokens 16384 --out "$OUT/moe"
    tests t-combine 150 tests/gpu/test_kernels_moe_prefill_gpu.py -k \
      "combine_gives and (16384-distinct-bm256] or odd-wg-1000 or modelopt)"
    ;;
  s43d)  # (~5 minutes: s43b cut) the prefill step with COMBINE in the 256-row form beside the default
    step variants-combine 280 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s43-combine \
      --variant combine=form.bm256.COMBINE=true
    ;;
  s43e)  # (~3 minutes) COMBINE's timings beside the route before only (the bench checks out bit for bit itself)
    step moe-combine 160 python3 bench/moe_prefill.py --combine bm256 --tokens 16384 --out "$OUT/moe"
    ;;
  s43b)  # (~8 minutes) the prefill step (8 x 2,048 over 100K) with COMBINE in the 256-row form beside the default,
    # then WG_PINGPONG's GPU cases
    step variants-combine 300 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s43-combine \
      --variant combine=form.bm256.COMBINE=true
    tests t-pingpong 150 tests/gpu/test_kernels_attention_prefill_gpu.py -k "pingpong"
    ;;
  s42e)  # (~4 minutes: s42d cut to the device time left) WG_PINGPONG once beside the emitter's form, one GPU case
    step attn-pingpong 130 python3 bench/attention_prefill.py --out "$OUT/attn" \
      --cases full:f8e4m3:100000 --tiles "$(pingpong_tiles)"
    tests t-pingpong 90 tests/gpu/test_kernels_attention_prefill_gpu.py -k "pingpong and full-long-100k-False"
    ;;
  s41e)  # (~3 minutes) the 128-row MoE form with SORT_ALONE (now that the sort is cheap): 2,048 / 4,096 tokens
    step moe-sort128 200 python3 bench/moe_prefill.py --out "$OUT/moe" --tokens 2048,4096 --only sort128
    ;;
  s40c)  # (~4 minutes) the router's selection with BLOCK_M tokens a program (one warp; 1 by default): GPU cases bitwise
    # against 1, the prefill router's timings; and s39h's 12th mirror case (not reached there)
    step router-m 100 python3 bench/router_prefill.py --out "$OUT/router" --only "select m2,select m4,select m8"
    tests t-router-m 100 tests/gpu/test_kernels_attn_router_gpu.py -k "block_m_bitwise"
    tests t-mirror12 90 tests/gpu/test_kernels_attention_prefill_gpu.py -k "tile_order and sliding"
    ;;
  s40d)  # (~2 minutes) s40c's timings alone: the prefill router with the selection's BLOCK_M 2 / 4 / 8 beside the default
    step router-m 100 python3 bench/router_prefill.py --out "$OUT/router" --only "select m2,select m4,select m8"
    ;;
  s39h)  # (~4 minutes) each MIRROR pass leaves the other pass's rows out before loading q (the pass over the
    # unmirrored slots, 28-33 us when every slot is mirrored): the mirror cases bitwise, the full and sliding spans
    tests t-skip 150 tests/gpu/test_kernels_attention_prefill_gpu.py -k "mirror_render or tile_order"  # (12 cases: ~110 s)
    step attn-skip 60 python3 bench/attention_prefill.py --out "$OUT/attn" --profile --cases full:f8e4m3:100000 \
      --tiles '[{"MIRROR": true, "WGMMA": true, "WG_SPLIT": true, "TILE_ORDER": true, "PDL": false}, {"MIRROR": true, "WGMMA": true, "WG_SPLIT": true, "TILE_ORDER": true}]'
    step slide-skip 60 python3 bench/attention_prefill.py --out "$OUT/slide" --profile --cases sliding:f8e4m3:100000 \
      --tiles '[{"MIRROR": true, "WGMMA": true, "WG_SPLIT": true, "PDL": false}, {"F16_DOT": true, "NUM_WARPS": 4, "EX2_FTZ": true, "Q16_OUT": true}]'
    ;;
  s39g)  # (~4 minutes) the sliding layer on the ring mirror with the WGMMA render (off since s30: its pass ~2x the Triton
    # pass's time at ~10 key blocks a tile): each launch's span with PDL off beside the step's Triton pass, then its ncu
    step slide-wgmma 120 python3 bench/attention_prefill.py --out "$OUT/slide" --profile --cases sliding:f8e4m3:100000 \
      --tiles '[{"F16_DOT": true, "NUM_WARPS": 4, "EX2_FTZ": true, "Q16_OUT": true, "PDL": false}, {"MIRROR": true, "WGMMA": true, "WG_SPLIT": true, "TILE_ORDER": true, "PDL": false}, {"MIRROR": true, "WGMMA": true, "WG_SPLIT": true, "PDL": false}, {"MIRROR": true, "PDL": false}]'
    step ncu-slide-wgmma 150 env OUT="$OUT/ncu" bash bench/ncu_source.sh attn-sliding-wgmma
    ;;
  s39f)  # (~5 minutes) the emitter's sliding tile with Q16_OUT: its GPU cases, the runtime's fp8 prefill test (the tiny
    # spec's sliding layers on it), the prefill step against the session's first form (8 warps, neither option)
    tests t-step-tile 150 tests/gpu/test_kernels_attention_prefill_gpu.py -k "sliding_step_tile"
    BEAMC_RUNTIME_STEPS=100 tests t-rt-fp8 200 tests/gpu/test_runtime_gpu.py -k "mirror_prefill_on_wgmma"
    step variants-s39f 280 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s39-q16 \
      --variant s38=attention_prefill.NUM_WARPS=8,attention_prefill.EX2_FTZ=false,attention_prefill.Q16_OUT=false
    ;;
  s39e)  # (~3 minutes) Q16_OUT (q's fp16 tile through the output rows: the score wgmma's A from shared memory, not
    # serialised for lack of registers at 4 warps): GPU cases bitwise, the sliding pass's tiles with / without it
    tests t-q16 150 tests/gpu/test_kernels_attention_prefill_gpu.py -k "q16_out"
    step slide-q16 120 python3 bench/attention_prefill.py --out "$OUT/slide" --profile \
      --cases sliding:f8e4m3:100000 --tiles '[{"F16_DOT": true, "NUM_WARPS": 4, "EX2_FTZ": true}, {"F16_DOT": true, "NUM_WARPS": 4, "EX2_FTZ": true, "Q16_OUT": true}, {"F16_DOT": true, "EX2_FTZ": true}, {"F16_DOT": true, "EX2_FTZ": true, "Q16_OUT": true}, {"F16_DOT": true, "NUM_WARPS": 4, "EX2_FTZ": true, "Q16_OUT": true, "NUM_STAGES": 2}, {"F16_DOT": true, "NUM_WARPS": 4, "EX2_FTZ": true, "BLOCK_M": 64}, {"F16_DOT": true, "NUM_WARPS": 4, "EX2_FTZ": true}, {"F16_DOT": true, "NUM_WARPS": 4, "EX2_FTZ": true, "Q16_OUT": true}]'
    ;;
  s39d)  # (~6 minutes) the sliding layers' step tile with EX2_FTZ (emitters.ATTENTION_SLIDING_PREFILL_TILES): its GPU
    # cases, the pass's ncu (what holds it now), the prefill step against 8 warps without EX2_FTZ (s39c's form)
    tests t-slide-ftz 150 tests/gpu/test_kernels_attention_prefill_gpu.py -k "sliding_step_tile"
    step ncu-slide 150 env OUT="$OUT/ncu" bash bench/ncu_source.sh attn-sliding
    step variants-s39d 280 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s39-ftz \
      --variant w8=attention_prefill.NUM_WARPS=8,attention_prefill.EX2_FTZ=false
    ;;
  s39|s39b|s39c)  # (~6 minutes) the sliding layers' prefill pass on 4 warps (emitters.ATTENTION_SLIDING_PREFILL_TILES):
    # its GPU cases and EX2_FTZ's, tiles around it (s39run1 / run2 ran TRIP_HELPERS / ONE_LOOP here: both removed),
    # then the prefill step against 8 warps
    tests t-slide4 150 tests/gpu/test_kernels_attention_prefill_gpu.py -k "sliding_step_tile or ex2_ftz"
    step slide-tiles4 120 python3 bench/attention_prefill.py --out "$OUT/slide" --profile \
      --cases sliding:f8e4m3:100000 --tiles '[{"F16_DOT": true}, {"F16_DOT": true, "NUM_WARPS": 4}, {"F16_DOT": true, "NUM_WARPS": 4, "EX2_FTZ": true}, {"F16_DOT": true, "NUM_WARPS": 4, "BLOCK_N": 128}, {"F16_DOT": true, "NUM_WARPS": 4, "BLOCK_M": 64, "BLOCK_N": 128, "NUM_STAGES": 2}, {"F16_DOT": true, "BLOCK_N": 128, "NUM_STAGES": 2}, {"F16_DOT": true, "NUM_WARPS": 4, "NUM_STAGES": 2}, {"F16_DOT": true, "NUM_WARPS": 4}]'
    step variants-s39 280 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s39-slide4 \
      --variant w8=attention_prefill.NUM_WARPS=8
    ;;
  s37-lite)  # (run as s36run7 while SPLIT_K was off by default; its label then: split-k, the default now)
    tests t-splitk 80 tests/gpu/test_kernels_attn_router_gpu.py -k "split_k and (512 or 4096 or odd)"
    step router-t512 40 python3 bench/router_prefill.py --out "$OUT/t512" --tokens 512 --only 'no-split-k'
    step router-t2048 40 python3 bench/router_prefill.py --out "$OUT/t2048" --tokens 2048 --only 'no-split-k'
    ;;
  s36b)  # the packed QKV+gate GEMM over rows up to a multiple of 8 (library.with_row_room) and BF16X3 by default: the
    # runtime's GPU tests that run it (TP 2's packed N = 196: the aligned route), the GEMM routes, the prefill step
    BEAMC_RUNTIME_STEPS=300 tests t-rt36 200 tests/gpu/test_runtime_gpu.py -k "tp2_rank_graphs or bf16_compiled_tracks"
    step prefill-gemms 60 python3 bench/prefill_gemms.py --out "$OUT"
    step variants-s36 200 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s36-room
    ;;
  router36)  # BF16X3 (the prefill router's W in three exact bf16 parts, three bf16 MMAs a step): GPU tests, then the
    # router's prefill variants at 16,384 and 2,048 tokens
    tests t-router36 150 tests/gpu/test_kernels_attn_router_gpu.py -k "bf16x3 or (test_moe_router and 4096)"
    # (run as s36run2 before BF16X3 became the default; its labels now: default = bf16x3, tf32x2 = the old default)
    step router36 150 python3 bench/router_prefill.py --out "$OUT" --only 'tf32x2,bf16x3 s2,bf16x3 s4 K32,bf16x3 T64 w4,bf16x3 E256 T64 K32,bf16x3 T256 E64'
    step router36-2k 60 python3 bench/router_prefill.py --out "$OUT/t2048" --tokens 2048 --only 'tf32x2,bf16x3 T64 w4'
    ;;
  atma4-step)  # the prefill step with the 256-row form's candidates (WG_ATMA; the A partition in stage 3 only)
    step variants-atma4 230 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s35-atma4 \
      --variant atma4=form.bm256.WG_LOAD_WARPS=4,form.bm256.WG_ACOPY=true,form.bm256.WG_ACOPY_REGS=40,form.bm256.WG_A32=true,form.bm256.WG_ACOPY4=false,form.bm256.WG_ATMA=true \
      --variant atma4-ds=form.bm256.WG_LOAD_WARPS=4,form.bm256.WG_ACOPY=true,form.bm256.WG_ACOPY_REGS=40,form.bm256.WG_A32=true,form.bm256.WG_ACOPY4=false,form.bm256.WG_ATMA=true,form.bm256.WG_DSTORE=true
    ;;
  atma-step)  # the prefill step (8 x 2,048 tokens over 100K) with WG_ATMA in the 256-row form, and WG_NOFENCE4 too
    step variants-atma 560 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s35-atma \
      --variant atma=form.bm256.WG_ATMA=true \
      --variant atma-nf4=form.bm256.WG_ATMA=true,form.bm256.WG_NOFENCE4=true
    ;;
  wtma)  # stage 3's words by TMA (WG_WTMA; the fence probe's answer decides how much it can give): tests, timings
    tests t-wtma 200 tests/gpu/test_kernels_moe_prefill_gpu.py -k "wtma or alate"
    step moe-wtma 200 python3 bench/moe_prefill.py --tokens 16384 --out "$OUT" \
      --only 'WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=8 (stage 3),(wtma)'
    ;;
  regs256)  # the 256-row form's store / A partitions with fewer registers (their MMA partitions not serialised)
    step moe-regs256 200 python3 bench/moe_prefill.py --tokens 16384 --out "$OUT" \
      --only 'WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=8 (stage 3),(regs256)'
    ;;
  half-step)  # the prefill step with WG_HALF in the emitter's forms, paired with the default package
    step variants-half 300 python3 bench/variants.py --out "$OUT/r" --prefill --once --reps 3 --tag=-s31 --variant half=moe_nvfp4_prefill.WG_HALF=true
    ;;
  moe-ncu)  # where stage 4 of the WGMMA MoE spends its time now (1.4 of 3.76 ms at 16,384 tokens: 25% slower per FLOP)
    step ncu-moe-wgmma 400 env OUT="$OUT" bash bench/ncu_source.sh moe-wgmma
    ;;
  persist)  # (36 kernel cases: six PERSIST forms, each compiled for four pair counts)
    tests t-persist 360 tests/gpu/test_kernels_moe_gpu.py -k "combine_variant and persist"
    BEAMC_RUNTIME_STEPS=300 tests t-rt-persist 150 tests/gpu/test_runtime_gpu.py -k persistent
    ;;
  persist-step)
    step variants-persist 540 python3 bench/variants.py --out "$OUT/r" --tag=-s32 --rounds "$ROUNDS" --variant persist=moe_nvfp4_decode.PERSIST=true --variant pns=moe_nvfp4_decode.PERSIST=true,moe_nvfp4_decode.SCAN_T1=false --variant pe1=moe_nvfp4_decode.PERSIST=true,moe_nvfp4_decode.EARLY1=true
    ;;
  decode-knobs)  # render options pinnable with --set that were never measured in the decode step
    step variants-knobs 540 python3 bench/variants.py --out "$OUT/r" --tag=-s32-knobs --rounds "$ROUNDS" --variant bw8=rmsnorm_boundary.NUM_WARPS=8 --variant bw4=rmsnorm_boundary.NUM_WARPS=4 --variant wbn16=attention_decode.WINDOW_BLOCK_N=16
    ;;
  runtime)
    export BEAMC_RUNTIME_STEPS=300
    tests t-rt-wgmma 200 tests/gpu/test_runtime_gpu.py -k wgmma
    step variants-prefill 360 python3 bench/variants.py --out "$OUT/r" --prefill --tag=-s31 --variant nowg=compile.moe_wgmma=false --variant nowga=attention_prefill.WGMMA=false
    ;;
  *)
    echo "unknown call $1: attn, sliding, combo, moe-prefill, moe-half, moe-half-lean, load8s3, w4aq, forms, parts2, regs256, fence, tma2, atma-step, atma4, atma4-step, emitter35, qkvg, s36, s36b, s37, s37b, s37c, s37d, s38, s38c, s38d, s38e, s38f, s39, s39b, s39c, s39d, s39e, s39f, s39g, s39h, s40, s40b, s40c, s40d, s41a, s41b, s41c, s41d, s41e, ncu37, s37-lite, router36, wtma, wtma-step, slide-tiles, half-step, moe-ncu, persist, persist-step, runtime, decode-knobs" >&2
    exit 2
    ;;
esac
echo "== summary"
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
# a call brings back at most 8 files: everything in one archive (s30run1 lost its variants JSON, the ninth file)
(cd "$OUT" && tar czf /tmp/plan-out.tgz . && find . -mindepth 1 -delete && mv /tmp/plan-out.tgz "$OUT/plan-out.tgz")
