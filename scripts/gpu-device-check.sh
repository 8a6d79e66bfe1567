#!/bin/bash
# Checks pyrometer's GPU paths against a real NVIDIA GPU (an H100 or H200 machine with the driver,
# PyTorch built for CUDA 13 and its CUPTI). Two parts, both by default, or one by name:
#
#   nvml     `pyrometer gpu` idle and under load, `record --gpu` of a workload alternating GPU
#            and CPU phases, and the agent's GPU gauges on /metrics (about 1 minute).
#   kernels  GPU time by Python stack (`record --gpu-kernels`) against torch.profiler on a
#            training loop with three phases (scripts/gpu_phases.py: matmuls, convolutions,
#            many small elementwise kernels), and what the injection costs (about 3 minutes):
#            - each phase's share of GPU time, pyrometer's against Kineto's (within 5 points);
#            - the share of kernel time whose stack reaches a phase's Python function (>= 95 %);
#            - the loop's slowdown under `record --gpu-kernels` at the default 1-in-N, from
#              alternating runs with and without it (<= 1.03x);
#            - CPU time per sampled launch (every launch sampled, with the probes against
#              without: what a stack costs the launching thread);
#            - torch.profiler with the injection on still sees every kernel.
#
# Everything it prints and writes goes under $OUT (default ./gpu-check); the channel of the
# recorded run is kept as $OUT/gpu-channel.dump, the real-GPU test data the stand-in tests can
# grow from. The binary is $PYROMETER (default target/debug/pyrometer), built where the CUDA
# headers were fetched so that it carries libpyrometer_cupti.so (written out here with
# `install-preload --gpu`); it needs no build tools on the GPU machine. $PYTHON is the
# interpreter with torch (default python3). Exits 1 when a figure misses its bound.
set -u
OUT=${OUT:-gpu-check}
B=${PYROMETER:-target/debug/pyrometer}
PY=${PYTHON:-python3}
PART=${1:-all}
mkdir -p "$OUT"
here=$(dirname "$0")
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu; do
    [ -e "$d/libnvidia-ml.so.1" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
step() { echo "=== $*"; }
failed=0

step machine
uname -r; id -u; nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total,power.limit --format=csv
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'

nvml() {
    step "pyrometer gpu, idle"
    timeout 30 "$B" gpu --duration 2s --gpu-interval 200ms -o "$OUT/idle.csv"; echo "exit $?"
    step "pyrometer gpu, under load"
    # Importing torch and starting CUDA take a few seconds before the first kernel runs.
    "$PY" "$here/gpu_load.py" 10 1 &
    load=$!
    sleep 5
    timeout 30 "$B" gpu --duration 4s --gpu-interval 200ms -o "$OUT/busy.csv"; echo "exit $?"
    wait $load
    step "record --gpu"
    timeout 60 "$B" record --gpu --gpu-interval 200ms -F 99 -o "$OUT/record.pb.gz" \
        -- "$PY" "$here/gpu_load.py" 6 1; echo "exit $?"
    step "agent /metrics"
    timeout -s INT 12 "$B" agent --collector http://127.0.0.1:9 --spool-dir /tmp/pyro-spool \
        --metrics-listen 127.0.0.1:9464 --gpu-interval 200ms --push-interval 2s \
        > "$OUT/agent.log" 2>&1 &
    agent=$!
    "$PY" "$here/gpu_load.py" 8 1 &
    load=$!
    sleep 6
    "$PY" -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:9464/metrics").read().decode())' \
        | grep -E '^pyrometer_gpu' | head -40
    wait $load; wait $agent; echo "agent exit $?"
    tail -5 "$OUT/agent.log"
}

kernels() {
    local lib steps=300
    # The library the binary carries; record uses the same copy (named by the variable), so the
    # runs with and without record load the same file.
    if ! lib=$("$B" install-preload --gpu "$OUT/lib" 2> "$OUT/install.log"); then
        cat "$OUT/install.log"
        echo "no libpyrometer_cupti.so: build pyrometer with the CUDA headers (cargo xtask cuda-headers, then cargo build)"
        failed=1
        return
    fi
    export PYROMETER_CUPTI_INJECT="$lib"
    step "record --gpu-kernels (default 1-in-N)"
    PYROMETER_GPU_DUMP="$OUT/gpu-channel.dump" timeout 120 "$B" record --gpu-kernels -F 99 \
        -o "$OUT/kernels.pb.gz" -- "$PY" "$here/gpu_phases.py" plain $steps \
        > "$OUT/record.json" 2> "$OUT/record.log"
    echo "exit $?"; cat "$OUT/record.log"
    "$B" report "$OUT/kernels.pb.gz" --type gpu_time -o "$OUT/gpu_time.folded"; echo "report exit $?"
    "$B" report "$OUT/kernels.pb.gz" --type gpu_time -o "$OUT/gpu_time.svg"
    "$B" record --gpu-kernels -o "$OUT/kernels.trace.json" -- "$PY" "$here/gpu_phases.py" plain 20 \
        > /dev/null 2>&1; echo "trace exit $?"

    step "torch.profiler, without the injection (the reference)"
    timeout 120 "$PY" "$here/gpu_phases.py" kineto $steps > "$OUT/kineto.json"; echo "exit $?"
    cat "$OUT/kineto.json"
    step "torch.profiler with the injection on"
    CUDA_INJECTION64_PATH="$lib" NVTX_INJECTION64_PATH="$lib" timeout 120 \
        "$PY" "$here/gpu_phases.py" kineto 50 > "$OUT/kineto-injected.json" 2> "$OUT/kineto-injected.log"
    echo "exit $?"; cat "$OUT/kineto-injected.json"; tail -3 "$OUT/kineto-injected.log"

    step "slowdown: alternating runs without and with record --gpu-kernels"
    : > "$OUT/slowdown.txt"
    for i in 1 2 3; do
        "$PY" "$here/gpu_phases.py" plain $steps | sed 's/^/base /' >> "$OUT/slowdown.txt"
        "$B" record --gpu-kernels -o "$OUT/slow-$i.pb.gz" -- "$PY" "$here/gpu_phases.py" plain $steps \
            2> /dev/null | sed 's/^/pyro /' >> "$OUT/slowdown.txt"
    done
    cat "$OUT/slowdown.txt"

    step "CPU per sampled launch: every launch sampled, probes attached or not"
    CUDA_INJECTION64_PATH="$lib" PYROMETER_GPU_SAMPLE_EVERY=1 "$PY" "$here/gpu_phases.py" plain 100 \
        > "$OUT/cost-idle.json"
    PYROMETER_GPU_SAMPLE_EVERY=1 "$B" record --gpu-kernels -o "$OUT/cost.pb.gz" \
        -- "$PY" "$here/gpu_phases.py" plain 100 > "$OUT/cost-probed.json" 2> "$OUT/cost.log"
    cat "$OUT/cost-idle.json" "$OUT/cost-probed.json"; grep -i "gpu" "$OUT/cost.log"

    step "figures"
    "$PY" - "$OUT" <<'EOF' || failed=1
import json, re, statistics, sys
out = sys.argv[1]
phases = ("matmul_phase", "conv_phase", "elementwise_phase")
ok = True

def check(name, good, text):
    global ok
    ok &= good
    print(f"{'ok  ' if good else 'MISS'} {name}: {text}")

# pyrometer: gpu_time by the phase function its stack reaches.
ours = dict.fromkeys(phases, 0)
total = 0
for line in open(f"{out}/gpu_time.folded"):
    stack, _, value = line.rstrip().rpartition(" ")
    value = int(value)
    total += value
    frames = stack.split(";")
    for p in phases:
        if any(f == p or f.startswith(p + " ") for f in frames):
            ours[p] += value
            break
reached = sum(ours.values())
check("kernel time under a phase function", reached >= 0.95 * total,
      f"{100 * reached / max(total, 1):.1f} % of {total / 1e9:.3f} s")
kin = json.load(open(f"{out}/kineto.json"))["phases_ns"]
kin_total = sum(kin.get(p, 0) for p in phases)
for p in phases:
    a = 100 * ours[p] / max(reached, 1)
    b = 100 * kin.get(p, 0) / max(kin_total, 1)
    check(f"{p} share", abs(a - b) <= 5, f"pyrometer {a:.1f} %, Kineto {b:.1f} %")
inj = json.load(open(f"{out}/kineto-injected.json"))
ref = json.load(open(f"{out}/kineto.json"))
per_step = lambda r: r["kernels"] / r["steps"]
check("torch.profiler with the injection on", per_step(inj) >= 0.99 * per_step(ref),
      f"{per_step(inj):.1f} kernels a step against {per_step(ref):.1f}")
runs = {"base": [], "pyro": []}
for line in open(f"{out}/slowdown.txt"):
    kind, _, js = line.partition(" ")
    runs[kind].append(json.loads(js)["seconds"])
ratio = statistics.median(runs["pyro"]) / statistics.median(runs["base"])
check("slowdown at the default 1-in-N", ratio <= 1.03,
      f"{ratio:.3f}x (medians of {runs['base']} and {runs['pyro']})")
idle = json.load(open(f"{out}/cost-idle.json"))
probed = json.load(open(f"{out}/cost-probed.json"))
log = open(f"{out}/cost.log").read()
m = re.search(r"(\d+) sampled", log)
if m:
    sampled = int(m.group(1))
    per = (probed["cpu"] - idle["cpu"]) / max(sampled, 1) * 1e6
    print(f"info CPU per sampled launch: {per:.1f} us ({sampled} sampled; Zymtrace quotes ~25 us)")
else:
    print("MISS CPU per sampled launch: no 'N sampled' in the summary")
    ok = False
sys.exit(0 if ok else 1)
EOF
}

case "$PART" in
nvml) nvml ;;
kernels) kernels ;;
all) nvml; kernels ;;
*) echo "usage: $0 [nvml|kernels|all]"; exit 2 ;;
esac
exit $failed
