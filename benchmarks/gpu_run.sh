#!/usr/bin/env bash
# The GPU checks of the hand-off and throughput work, as one script for one device call (< 8 min on
# one H200): the site trainer against a plain torchrun loop on a 1.5B Llama-style model (hf-causal-lm,
# bf16 with fp32 master weights, DDP and ZeRO-2, 50 steps a round, the whole round counted, MFU),
# then the trainer <-> ClientApp hand-off in GB/s against memcpy, on the GPU and on the host.
# Every part has its own time limit, so one that overruns leaves the others their figures.
#
#   bash benchmarks/gpu_run.sh            # on the GPU machine; outputs under $OUT (or ./gpu-out)
#   SMOKE=1 bash benchmarks/gpu_run.sh    # on a CPU: the same parts at toy size (gloo, fp32)
#   PART=federation bash benchmarks/gpu_run.sh   # instead: the 1.5B federation, 3 rounds (cut at 510 s; not yet timed)
#
# Wheels for what that machine lacks (pydantic, cryptography, flwr and their needs) travel in
# .gpu-wheels/ (docs/benchmarks/gpu_federation.md says how to fetch them).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 FLWR_TELEMETRY_ENABLED=0 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
if [ -d .gpu-wheels ] && [ -z "${SMOKE:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu-wheels/*.whl \
    > "$OUT/env.txt" 2>&1 || { echo "wheel install failed"; cat "$OUT/env.txt"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH  # flwr's commands
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
{
  date -u; uname -a; nproc; free -g; df -h /dev/shm
  nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
} >> "$OUT/env.txt" 2>&1
# the hand-off files of a 1.5B fp32 model need ~19 GiB of /dev/shm; a container's default is 64 MiB
if [ -z "${SMOKE:-}" ] && [ "$(df --output=avail -k /dev/shm | tail -1)" -lt 25000000 ]; then
  mount -o remount,size=64G /dev/shm >> "$OUT/env.txt" 2>&1 || echo "could not enlarge /dev/shm" >> "$OUT/env.txt"
  df -h /dev/shm >> "$OUT/env.txt"
fi

if [ "${PART:-}" = federation ]; then
  FED=(); T_FED=510
  [ -n "${SMOKE:-}" ] && FED=(--smoke) && T_FED=900
  echo "load $(cut -d' ' -f1-3 /proc/loadavg) before gpu_federation" >> "$OUT/env.txt"
  timeout -k 10 $T_FED $PY benchmarks/gpu_federation.py "${FED[@]}" > "$OUT/gpu_federation.log" 2>&1 \
    || echo "gpu_federation ended with status $?" >> "$OUT/gpu_federation.log"
  tail -n 4 "$OUT/env.txt"
  grep -v "^RESULT" "$OUT/gpu_federation.log" | tail -n 12
  grep -h "^RESULT\|ended with status" "$OUT/gpu_federation.log" | tee "$OUT/results.txt"
  exit 0
fi
if [ -n "${SMOKE:-}" ]; then
  THR=(--smoke --model hf-tiny --strategies ddp,zero2 --steps 3 --rounds 1)
  HO_GPU=(--device cpu --mb 20,60 --rounds 1)
  HO_CPU=(--device cpu --mb 20,60 --rounds 1)
  T_THR=900; T_HO=300
else
  THR=(--model hf-1.5b --strategies ddp,zero2 --steps 50 --rounds 1 --batch 8)
  HO_GPU=(--device cuda --mb 500,3000 --rounds 2)
  HO_CPU=(--device cpu --mb 500,3000 --rounds 2)
  T_THR=340; T_HO=50
fi
echo "load $(cut -d' ' -f1-3 /proc/loadavg) before gpu_throughput" >> "$OUT/env.txt"
timeout -k 10 $T_THR $PY benchmarks/gpu_throughput.py "${THR[@]}" > "$OUT/gpu_throughput.log" 2>&1 \
  || echo "gpu_throughput ended with status $?" >> "$OUT/gpu_throughput.log"
echo "load $(cut -d' ' -f1-3 /proc/loadavg) before handoff (device)" >> "$OUT/env.txt"
timeout -k 10 $T_HO $PY benchmarks/handoff.py "${HO_GPU[@]}" > "$OUT/handoff_device.log" 2>&1 \
  || echo "handoff (device) ended with status $?" >> "$OUT/handoff_device.log"
echo "load $(cut -d' ' -f1-3 /proc/loadavg) before handoff (host)" >> "$OUT/env.txt"
timeout -k 10 $T_HO $PY benchmarks/handoff.py "${HO_CPU[@]}" > "$OUT/handoff_host.log" 2>&1 \
  || echo "handoff (host) ended with status $?" >> "$OUT/handoff_host.log"
grep -h "^RESULT\|ended with status\|Error\|error:" "$OUT/gpu_throughput.log" "$OUT/handoff_device.log" \
  "$OUT/handoff_host.log" | sort -u | sed 's/^/  /' > "$OUT/results.txt"
tail -n 4 "$OUT/env.txt"
for f in gpu_throughput handoff_device handoff_host; do
  echo "== $f"; grep -v "^RESULT" "$OUT/$f.log" | tail -n 6
done
echo "== RESULT lines"
cat "$OUT/results.txt"
