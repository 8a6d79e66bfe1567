#!/bin/bash
# Checks the NVML path against a real NVIDIA GPU (the project's device machine, where a task
# has one): `pyrometer gpu` idle and under load, `record --gpu` of a workload alternating GPU
# and CPU phases, and the agent's GPU gauges on /metrics. Everything it prints and writes goes
# under $OUT (default ./gpu-check). The binary comes from $PYROMETER (default
# target/debug/pyrometer); it needs no build tools on the GPU machine.
set -u
OUT=${OUT:-gpu-check}
B=${PYROMETER:-target/debug/pyrometer}
mkdir -p "$OUT"
here=$(dirname "$0")
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu; do
    [ -e "$d/libnvidia-ml.so.1" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
step() { echo "=== $*"; }
step machine
uname -r; id -u; nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total,power.limit --format=csv
step "pyrometer gpu, idle"
timeout 30 "$B" gpu --duration 2s --gpu-interval 200ms -o "$OUT/idle.csv"; echo "exit $?"
step "pyrometer gpu, under load"
# Importing torch and starting CUDA take a few seconds before the first kernel runs.
python3 "$here/gpu_load.py" 10 1 &
load=$!
sleep 5
timeout 30 "$B" gpu --duration 4s --gpu-interval 200ms -o "$OUT/busy.csv"; echo "exit $?"
wait $load
step "record --gpu"
timeout 60 "$B" record --gpu --gpu-interval 200ms -F 99 -o "$OUT/record.pb.gz" \
    -- python3 "$here/gpu_load.py" 6 1; echo "exit $?"
step "agent /metrics"
timeout -s INT 12 "$B" agent --collector http://127.0.0.1:9 --spool-dir /tmp/pyro-spool \
    --metrics-listen 127.0.0.1:9464 --gpu-interval 200ms --push-interval 2s \
    > "$OUT/agent.log" 2>&1 &
agent=$!
python3 "$here/gpu_load.py" 8 1 &
load=$!
sleep 6
python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:9464/metrics").read().decode())' \
    | grep -E '^pyrometer_gpu' | head -40
wait $load; wait $agent; echo "agent exit $?"
tail -5 "$OUT/agent.log"
