"""A PyTorch training loop with three phases, for scripts/gpu-device-check.sh on a real GPU:
matmul_phase (a few large matrix products), conv_phase (convolutions) and elementwise_phase
(many small elementwise kernels, launch-bound). Each phase is its own Python function, so
pyrometer's `gpu_time` stacks and torch.profiler's record_function ranges name the same thing.

Usage: gpu_phases.py MODE [STEPS]
  plain     run STEPS steps after a warm-up; print {"seconds": loop time, "cpu": process CPU
            seconds of the loop, "launches": kernel launches made}
  kineto    the same under torch.profiler (CUDA activities, record_function per phase); print
            each phase's device time (ns) as Kineto attributes it, and its kernel count
"""
import json
import sys
import time

import torch

DEV = "cuda"


def matmul_phase(a, b):
    for _ in range(4):
        a = torch.tanh(a @ b)
    return a


def conv_phase(x, conv):
    for _ in range(3):
        x = torch.relu(conv(x))
    return x


def elementwise_phase(t):
    for _ in range(60):
        t = t * 1.0001 + 0.0001
    return t


def step(state, profiled=False):
    a, b, x, conv, t = state
    phases = (
        ("matmul_phase", lambda: matmul_phase(a, b)),
        ("conv_phase", lambda: conv_phase(x, conv)),
        ("elementwise_phase", lambda: elementwise_phase(t)),
    )
    for name, fn in phases:
        if profiled:
            with torch.profiler.record_function(name):
                fn()
        else:
            fn()


def setup():
    torch.manual_seed(0)
    a = torch.randn(2048, 2048, device=DEV)
    b = torch.randn(2048, 2048, device=DEV) / 45
    x = torch.randn(16, 64, 64, 64, device=DEV)
    conv = torch.nn.Conv2d(64, 64, 3, padding=1, device=DEV)
    t = torch.randn(256, device=DEV)
    return a, b, x, conv, t


def plain(steps):
    state = setup()
    with torch.no_grad():
        for _ in range(5):
            step(state)
        torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step(state)
        torch.cuda.synchronize()
        t1, c1 = time.perf_counter(), time.process_time()
    # 4 matmuls + 4 tanh, 3 convs (+bias) + 3 relu, 60 x (mul, add): about 134 launches a step.
    print(json.dumps({"seconds": t1 - t0, "cpu": c1 - c0, "steps": steps}), flush=True)


def kineto(steps):
    state = setup()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.no_grad():
        for _ in range(5):
            step(state)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(steps):
                step(state, profiled=True)
            torch.cuda.synchronize()
    phases = {}
    kernels = 0
    for e in prof.events():
        if e.name in ("matmul_phase", "conv_phase", "elementwise_phase"):
            # Device time of the kernels launched within the range (torch names the field
            # device_time_total since 2.4, cuda_time_total before).
            total = getattr(e, "device_time_total", None)
            if total is None:
                total = e.cuda_time_total
            phases[e.name] = phases.get(e.name, 0) + int(total * 1000)
    for e in prof.key_averages():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            kernels += e.count
    print(json.dumps({"phases_ns": phases, "kernels": kernels, "steps": steps}), flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    {"plain": plain, "kineto": kineto}[mode](steps)
