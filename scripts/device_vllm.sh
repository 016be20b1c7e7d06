#!/usr/bin/env bash
# The project's GPU workflow for the vLLM backend (docs/gpu.md says when to use which step).
#
# Here (the development machine, from the repository root):
#   scripts/device_vllm.sh build        build the carried vLLM 0.26 set under .device/vllm (pieces a, b; ~4 min)
#                                       with ../shared/tools/device-vllm/build (DEVICE_VLLM_TOOL overrides the path)
#   scripts/device_vllm.sh prepare-rl   make .device/rl: a small random Llama, its NVFP4 conversion (llm-compressor),
#                                       the prepared data and adapter 0 of a 2-step run with rollout.backend=vllm,
#                                       and bench.yaml (the orchestrated benchmark's config)
#   scripts/device_vllm.sh carry        print the `carry` list and command of each device run, in order
#
# On the GPU machine (one device run per piece folder, back to back: the machine is given back after
# 30 s idle and /tmp, where the pieces and the install live, goes with it):
#   scripts/device_vllm.sh install      stash the carried piece; exit 3 until the set is complete, then install
#                                       vLLM into /tmp/vllm-site (exit 0)
#   scripts/device_vllm.sh gpu-tests    python -m pytest -m gpu tests/test_vllm_engine_gpu.py tests/test_vllm_gemv_gpu.py
#   scripts/device_vllm.sh rl           the 2-step RL run of .device/rl with the vLLM backend (qerl run)
#   scripts/device_vllm.sh bench [ARGS] benchmarks/rollout_throughput.py ARGS (nf4-rR engines: carry .device/exp/d too)
#   scripts/device_vllm.sh all-b        install (piece b), then gpu-tests and rl, logs under $OUT
#   scripts/device_vllm.sh service-tests   the rollout service's GPU test (qerl serve on stock vllm serve;
#                                       carry .device/svc for the server's wheels)
#   scripts/device_vllm.sh orchestrated [ARGS]  benchmarks/orchestrated_step.py on .device/rl/bench.yaml
#                                       (carry .device/rl and .device/svc)
#   scripts/device_vllm.sh kernels      issue 17's decode GEMMs: build the CUDA one, the `gpu` tests of both
#                                       kernels, then benchmarks/nvfp4_gemv.py (Triton, CUDA with both code
#                                       layouts, Marlin, cuBLAS, LoRA stock and dual stream) -> $OUT/nvfp4_gemv.json
#                                       (4.5 min in session 13, before the repacked arms)
#   scripts/device_vllm.sh kernel-bound [ARGS] benchmarks/nvfp4_gemv_bound.py ARGS (the GEMV's reads and arithmetic apart,
#                                       both code layouts) -> $OUT/nvfp4_gemv_bound.json; the next call after
#                                       `kernels` (the built extension is cached in /tmp/qerl-cache)
#   scripts/device_vllm.sh kernel-ncu [GROUPS] [CONFIG]
#                                       Nsight Compute (`--set full`) on one GEMV call of each group (default
#                                       gate_up,down; CONFIG the GEMV's JSON config, default the repacked codes):
#                                       $OUT/ncu_<group>.ncu-rep, its details page as text and its SASS source
#                                       page (per-instruction stall samples) as CSV (~2 min with the build), and
#                                       benchmarks/ncu_stalls.py's summary of it -> $OUT/ncu_stalls.json
#   scripts/device_vllm.sh train-memory the chunked-MLP memory arms of benchmarks/train_step.py (micro-batch 2
#                                       and 8, offload in both arms) -> $OUT/train_step_mlpchunk.json (~3-4 min)
#   scripts/device_vllm.sh rl-step      benchmarks/rl_step.py (BF16 vs NVFP4 (+ AQN), 7B shape) -> $OUT/rl_step.json
#                                       (~8.5 min; a second call with `--arms nvfp4-aqn` and --merge if cut short;
#                                       on an H100 both arms need ~500 s: --deadline-s 550 under `timeout 595`)
#
# Every device step exports PYTHONPATH=/tmp/vllm-site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 (flashinfer
# is not carried) and writes its log under $OUT when OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-help}
shift || true
OUT=${OUT:-/tmp/qerl-out}
mkdir -p "$OUT"

gpu_env() {
  export PYTHONPATH=/tmp/vllm-site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
  export TOKENIZERS_PARALLELISM=false
}

kernel_env() {  # the decode GEMM's extension is built into (and reused from) QERL_CACHE_DIR; ninja sits beside python3
  gpu_env
  export QERL_CACHE_DIR=${QERL_CACHE_DIR:-/tmp/qerl-cache} PATH=$(dirname "$(command -v python3)"):$PATH
}

svc_wheels() {
  # vllm serve's own dependencies that the GPU image lacks (uvicorn, model-hosting-container-standards, ...).
  [ -f /tmp/vllm-site/.svc ] && return 0
  ls .device/svc/wheels/*.whl >/dev/null 2>&1 || { echo "carry .device/svc (the server's wheels)" >&2; return 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/vllm-site .device/svc/wheels/*.whl \
    && touch /tmp/vllm-site/.svc
}

install() {
  # Folders carried by earlier calls stay on a warm machine, so run every piece's install.sh that is
  # here (each stashes its own piece; the one that completes the set installs), not just the first.
  if [ -f /tmp/vllm-site/.complete ]; then echo "vllm already installed in /tmp/vllm-site"; return 0; fi
  local script rc=2
  for script in .device/vllm/*/install.sh; do
    [ -f "$script" ] || continue
    bash "$script"; rc=$?
    [ "$rc" = 0 ] && return 0
  done
  [ "$rc" = 2 ] && echo "no carried piece (.device/vllm/*/install.sh) and no /tmp/vllm-site: carry .device/vllm/a, then b" >&2
  return "$rc"
}

gpu_tests() {
  gpu_env
  export QERL_CACHE_DIR=${QERL_CACHE_DIR:-/tmp/qerl-cache} PATH=$(dirname "$(command -v python3)"):$PATH  # ninja
  timeout "${GPU_TESTS_TIMEOUT:-900}" python3 -m pytest -m gpu tests/test_vllm_engine_gpu.py tests/test_vllm_gemv_gpu.py \
    -v -s -p no:cacheprovider \
    "$@" 2>&1 | tee "$OUT/gpu_tests.log"
  return "${PIPESTATUS[0]}"
}

rl() {
  gpu_env
  # The trainer's NVFP4 matmul: the pure-PyTorch reference path (QERL_NVFP4_BACKEND=torch), so that
  # this run tests the vLLM backend and not the Triton kernels (their own tests cover those).
  export QERL_NVFP4_BACKEND=${QERL_NVFP4_BACKEND:-torch}
  local t0=$SECONDS
  # The workspace's own resolved config: a default changed in config.py since prepare-rl cannot make
  # `qerl run` refuse the workspace (it did once: data.synthetic_levels).
  local cfg=.device/rl/ws/config.yaml
  [ -f "$cfg" ] || cfg=.device/rl/config.yaml
  timeout "${RL_TIMEOUT:-900}" python3 -m qerl_lib run -c "$cfg" "$@" 2>&1 | tee "$OUT/rl.log"
  local rc=${PIPESTATUS[0]}
  echo "rl run: rc=$rc, $((SECONDS - t0)) s wall" | tee -a "$OUT/rl.log"
  for f in reports/metrics.json reports/steps.csv vllm_engine.json stage_times.jsonl; do
    [ -f ".device/rl/ws/$f" ] && cp ".device/rl/ws/$f" "$OUT/rl_$(basename "$f")"
  done
  return "$rc"
}

case "$cmd" in
  build)
    tool=${DEVICE_VLLM_TOOL:-../shared/tools/device-vllm/build}
    "$tool" .device/vllm
    ;;
  prepare-rl)
    py=${PYTHON:-.venv/bin/python}
    rm -rf .device/rl && mkdir -p .device/rl
    "$py" - <<'EOF'
import sys
sys.path.insert(0, "tests")
from pathlib import Path
from test_vllm_engine import build_small_dense
build_small_dense(Path(".device/rl/base"))
EOF
    cat > .device/rl/config.yaml <<'EOF'
# A 2-step QeRL run on a small random Llama (hidden 256, 2 layers, vocab 256) with the vLLM backend:
# NVFP4 base (llm-compressor), LoRA r16 (rollouts of 32 rows on the merged dense path, evaluations of 16
# on Marlin + dual-stream LoRA kernels), AQN noisy from step 1, DAPO without dynamic sampling (so the
# update trains on every group even when a random model earns no reward).
run: {root: .device/rl/ws, steps: 2, seed: 0}
data: {synthetic_train: 64, synthetic_test: 8}
model: {base: .device/rl/base, quant: nvfp4}
lora: {r: 16, alpha: 32}
rollout: {backend: vllm, prompts_per_step: 8, group_size: 4, max_new_tokens: 32,
          vllm_gpu_memory_utilization: 0.3, vllm_enforce_eager: false, vllm_max_lora_rank: 16,
          vllm_dense_above: 16, vllm_lora_dual_stream: true}
algo: {dynamic_sampling: false}
aqn: {stages: 2}
eval: {max_prompts: 8, k: 2, max_new_tokens: 32}
EOF
    for s in prepare convert init_adapter; do
      "$py" -m qerl_lib stage "$s" -c .device/rl/config.yaml || exit 1
    done
    # benchmarks/orchestrated_step.py's config (`orchestrated`): this run at the size of a real rollout,
    # 64 prompts x G = 8 per step up to 256 new tokens (the model has 512 positions and 225-token prompts),
    # 3 steps, the overlong buffer over all 256 tokens (benchmarks/results/orchestrated_step.json)
    "$py" -m qerl_lib config -c .device/rl/config.yaml -s run.steps=3 -s rollout.prompts_per_step=64 \
      -s rollout.group_size=8 -s rollout.max_new_tokens=256 -s reward.overlong_buffer=256 > .device/rl/bench.yaml || exit 1
    du -sh .device/rl
    ;;
  carry)
    cat <<'EOF'
run 1: carry [".device/vllm/a"]                command: bash scripts/device_vllm.sh install      (exits 3)
run 2: carry [".device/vllm/b", ".device/rl"]  command: bash scripts/device_vllm.sh all-b        (install, RL run,
       GPU tests; each starts an engine: 93 s measured for the small test model with CUDA graphs)
run 3: carry []                                command: bash scripts/device_vllm.sh bench --out $OUT/rollout_throughput.json
       (the full matrix needs about 6 engines x (2-2.5 min start + 1-2 min cells): split it with --engines and
        --no-profile across calls, then: python benchmarks/rollout_throughput.py --merge A.json B.json --out ...)
EOF
    ;;
  install) install ;;
  service-tests)
    install || exit $?
    svc_wheels || exit $?
    gpu_env
    timeout "${GPU_TESTS_TIMEOUT:-540}" python3 -m pytest -m gpu tests/test_rollout_service_gpu.py -v -s -p no:cacheprovider \
      "$@" 2>&1 | tee "$OUT/service_tests.log"
    exit "${PIPESTATUS[0]}"
    ;;
  orchestrated)
    install || exit $?
    svc_wheels || exit $?
    gpu_env
    export QERL_NVFP4_BACKEND=${QERL_NVFP4_BACKEND:-torch}
    timeout "${ORCH_TIMEOUT:-560}" python3 benchmarks/orchestrated_step.py -c .device/rl/bench.yaml --work /tmp/qerl-orch \
      --out "$OUT/orchestrated_step.json" "$@" 2>&1 | tee "$OUT/orchestrated.log"
    rc=${PIPESTATUS[0]}
    cp /tmp/qerl-orch/stages.log "$OUT/orchestrated_stages.log" 2>/dev/null
    cp /tmp/qerl-orch/orchestrated.serve.log "$OUT/orchestrated_serve.log" 2>/dev/null
    exit "$rc"
    ;;
  gpu-tests) gpu_tests "$@" ;;
  rl) rl "$@" ;;
  bench)
    kernel_env  # nvfp4g engines build the CUDA decode GEMM (ninja beside python3)
    [ -f /tmp/vllm-site/.complete ] || { echo "vLLM is not installed in /tmp/vllm-site (run the install pieces first)" >&2; exit 2; }
    # The nf4 engines need bitsandbytes: carry .device/exp/d (scripts/device_experiment.sh pack) in this call.
    for w in .device/exp/d/wheels/bitsandbytes-*.whl; do
      [ -f "$w" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vllm-site "$w"
    done
    python3 benchmarks/rollout_throughput.py "$@" 2>&1 | tee "$OUT/bench.log"
    exit "${PIPESTATUS[0]}"
    ;;
  kernels)
    kernel_env
    python3 -c "import time; from qerl_lib.kernels import nvfp4_gemv_cuda as C; t = time.time(); C.load_extension(); print('CUDA decode GEMM built in', round(time.time() - t, 1), 's')" 2>&1 | tee "$OUT/kernels_build.log"
    timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_nvfp4_gemv_cuda.py tests/test_nvfp4_gemv.py \
      2>&1 | tee "$OUT/kernels_gpu_tests.log" | tail -30
    timeout 300 python3 benchmarks/nvfp4_gemv.py --out "$OUT/nvfp4_gemv.json" 2>&1 | tee "$OUT/nvfp4_gemv.log" | tail -40
    ;;
  kernel-bound)
    kernel_env
    timeout 300 python3 benchmarks/nvfp4_gemv_bound.py --out "$OUT/nvfp4_gemv_bound.json" "$@" 2>&1 | tee "$OUT/nvfp4_gemv_bound.log" | tail -20
    ;;
  kernel-ncu)
    kernel_env
    groups=${1:-gate_up,down}
    config=${2:-'{"repacked": true}'}
    python3 -c "from qerl_lib.kernels import nvfp4_gemv_cuda as C; C.load_extension()" || exit 4  # built outside the profiler
    for g in ${groups//,/ }; do
      timeout 200 ncu -f -k regex:gemv_kernel --launch-count 1 --set full --import-source yes -o "$OUT/ncu_$g" \
        python3 benchmarks/nvfp4_gemv_bound.py --once --groups "$g" --config "$config" 2>&1 | tail -5
      ncu -i "$OUT/ncu_$g.ncu-rep" --page details > "$OUT/ncu_$g.txt" 2>&1
      ncu -i "$OUT/ncu_$g.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${g}_sass.csv" 2>&1
      grep -E "Duration|Registers Per|Achieved Active Warps|Issued Warp|Eligible Warps" "$OUT/ncu_$g.txt" | head -8
    done
    python3 benchmarks/ncu_stalls.py "$OUT"/ncu_*_sass.csv --out "$OUT/ncu_stalls.json"  # why the warps wait
    ;;
  train-memory)
    gpu_env
    python3 benchmarks/train_step.py --mode step --micro-batches 2 8 --arms nvfp4-dq:offload \
      nvfp4-dq:offload:mlpchunk1152 nvfp4-dq:offload:mlpchunk2304 bf16:offload bf16:offload:mlpchunk1152 \
      bf16:offload:mlpchunk2304 --out "$OUT/train_step_mlpchunk.json" 2>&1 | tee "$OUT/train_step_mlpchunk.log" | tail -40
    ;;
  rl-step)
    kernel_env  # the NVFP4 engine builds the CUDA decode GEMM (rollout.vllm_gemv_kernel: auto)
    [ -f /tmp/vllm-site/.complete ] || { echo "vLLM is not installed in /tmp/vllm-site (run the install pieces first)" >&2; exit 2; }
    python3 benchmarks/rl_step.py --out "$OUT/rl_step.json" "$@" 2>&1 | tee "$OUT/rl_step.log" | tail -40
    ;;
  all-b)
    install || exit $?
    rl; r=$?
    gpu_tests; t=$?
    echo "rl rc=$r gpu-tests rc=$t"
    exit $((t != 0 || r != 0))
    ;;
  *)
    sed -n '2,/^set -uo/p' "$0" | sed '$d'  # the header above
    ;;
esac
