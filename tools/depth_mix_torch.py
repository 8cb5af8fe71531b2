#!/usr/bin/env python3
"""PyTorch eager reference timing of the AttnRes depth mix (SPEC 2), forward + backward, for the
side-by-side comparison with attnres's fused kernel (tests/cuda_bench.cpp prints the same shape).

One mixer: S sources v_i (N, d), a shared pseudo-query w (d) and key-norm gain g (d):
    k_i = RMSNorm(v_i) * g,  s_i = k_i . w,  a = softmax_i(s),  x = sum_i a_i v_i
then the backward of sum(x * dx) into the sources and the query. Prints one table row per
variant (eager; torch.compile with --compile) with the median of the timed runs in ms and the
bytes moved at the minimum (read S sources and dx, write S source gradients) per ms.

With --attention it also times PyTorch's causal scaled_dot_product_attention (its flash or cuDNN
kernel) in bf16, forward and forward + backward, at the shape cuda_bench's attention rows use
(B 8, T 512, H 12, hd 64), with the same FLOP count (2 B H T^2 hd forward, 2.5 times that back).

Usage: tools/depth_mix_torch.py [--device cuda] [--n 8192] [--d 1024] [--sources 9] [--compile]
                                [--attention]
       (--device cpu --n 64 --d 64 checks the script on a machine without a GPU)
"""
import argparse
import statistics
import time

import torch


def depth_mix(v, w, g, eps=1e-5):
    # v (S, N, d); w, g (d)
    r = torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    s = torch.einsum("snd,d->sn", v * r, w * g)
    a = torch.softmax(s, dim=0)
    return torch.einsum("sn,snd->nd", a, v)


def timed(fn, device, reps):
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--sources", type=int, default=9)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--attention", action="store_true")
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("depth_mix_torch: no CUDA device for PyTorch")
        return
    torch.manual_seed(0)
    S, N, d = a.sources, a.n, a.d
    v = torch.randn(S, N, d, device=a.device, requires_grad=True)
    w = (0.1 * torch.randn(d, device=a.device)).requires_grad_()
    g = torch.ones(d, device=a.device, requires_grad=True)
    dx = torch.randn(N, d, device=a.device)
    variants = [("PyTorch eager", depth_mix)]
    if a.compile:
        variants.append(("torch.compile", torch.compile(depth_mix)))
    bytes_min = 4.0 * (2 * S + 1) * N * d
    print(f"| depth mix fwd+bwd, {S} sources | N {N}, d {d} | ms | GB/s at the minimum traffic |")
    print("|---|---|---|---|")
    for name, fn in variants:
        def step():
            v.grad = w.grad = g.grad = None
            (fn(v, w, g) * dx).sum().backward()
        ms = timed(step, a.device, a.reps)
        print(f"| {name} ({torch.__version__}, {a.device}) | same | {ms:.3f} | "
              f"{bytes_min / ms / 1e6:.0f} |")
    if a.attention:
        attention(a)


def attention(a):
    if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        print(f"| attention: torch {torch.__version__} has no scaled_dot_product_attention | | | |")
        return
    B, T, H, hd = (8, 512, 12, 64) if a.device == "cuda" else (2, 32, 4, 64)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    q, k, v = (torch.randn(B, H, T, hd, device=a.device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    do = torch.randn(B, H, T, hd, device=a.device, dtype=dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fwd():
        with torch.no_grad():
            sdpa(q, k, v, is_causal=True)

    def both():
        q.grad = k.grad = v.grad = None
        sdpa(q, k, v, is_causal=True).backward(do)
    f, fb = timed(fwd, a.device, a.reps), timed(both, a.device, a.reps)
    flop = 2.0 * B * H * T * T * hd
    print(f"| attention fwd / fwd+bwd, PyTorch SDPA causal ({torch.__version__}, {dtype}) | "
          f"B {B}, T {T}, H {H}, hd {hd} | {f:.3f} / {fb:.3f} | "
          f"{flop / f / 1e9:.1f} / {3.5 * flop / fb / 1e9:.1f} TFLOP/s (causal) |")


if __name__ == "__main__":
    main()
