"""GPU workload for checking the NVML path on a real GPU (scripts/gpu-device-check.sh).

Alternates GPU-bound and CPU-bound phases of PHASE seconds for DURATION seconds in all, so
`record --gpu`'s "idle while on-CPU" share should come out near one half, and holds a known
amount of device memory (1 GiB) while it runs.

    python3 scripts/gpu_load.py [DURATION] [PHASE]
"""
import sys
import time

import torch


def gpu_phase(a, b, until):
    n = 0
    while time.monotonic() < until:
        a @ b
        n += 1
        if n % 16 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()


def cpu_phase(until):
    x = 0
    while time.monotonic() < until:
        for i in range(10000):
            x += i
    return x


def main():
    duration = float(sys.argv[1]) if len(sys.argv) > 1 else 6.0
    phase = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.monotonic() + duration
    gpu = True
    while time.monotonic() < end:
        until = min(end, time.monotonic() + phase)
        if gpu:
            gpu_phase(a, b, until)
        else:
            cpu_phase(until)
        gpu = not gpu
    del held


if __name__ == "__main__":
    main()
