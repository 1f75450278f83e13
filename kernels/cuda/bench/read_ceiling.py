#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
# The H200's read ceiling against the decode LM head (kernels/cuda/bench/NOTES.md "The read ceiling
# and the LM head"): torch.sum over 2 GiB of bf16, a 2 GiB copy, cuBLAS GEMV of the LM head's shape
# (151936 x 2048 bf16, three rotated copies), 8 columns, and 8 separate expert-shaped GEMVs.
# PyTorch runs on the GPU machine only; it is never part of the product.
#     python3 kernels/cuda/bench/read_ceiling.py
import torch, time
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
dev = 'cuda'
def bench(fn, it=50):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(it):
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts)//2] * 1e3  # us
# pure read: sum over 2 GiB of bf16 (rotating buffers over > L2)
N = 1 << 30
x = torch.randn(N, dtype=torch.bfloat16, device=dev)
t = bench(lambda: torch.sum(x, dtype=torch.float32), 20)
print(f"read (torch.sum bf16 2 GiB): {t:.1f} us = {2*N/t/1e3:.0f} GB/s")
y = torch.empty_like(x)
t = bench(lambda: y.copy_(x), 20)
print(f"copy 2 GiB: {t:.1f} us = {4*N/t/1e3:.0f} GB/s (read+write)")
# LM head GEMV: 151936 x 2048 bf16, several copies to defeat L2
Ws = [torch.randn(151936, 2048, dtype=torch.bfloat16, device=dev) for _ in range(3)]
v = torch.randn(2048, 1, dtype=torch.bfloat16, device=dev)
k = [0]
def gemv():
    k[0] = (k[0] + 1) % 3
    return torch.matmul(Ws[k[0]], v)
t = bench(gemv, 30)
print(f"cuBLAS GEMV 151936x2048 bf16 (622 MB): {t:.1f} us = {151936*2048*2/t/1e3:.0f} GB/s")
v8 = torch.randn(2048, 8, dtype=torch.bfloat16, device=dev)
t = bench(lambda: torch.matmul(Ws[1], v8), 30)
print(f"cuBLAS 151936x2048 x 8 cols: {t:.1f} us = {151936*2048*2/t/1e3:.0f} GB/s")
# expert-like: 8 separate [gate;up] 1536x2048 GEMVs (6.3 MB each) from a pool of 128
E = [torch.randn(1536, 2048, dtype=torch.bfloat16, device=dev) for _ in range(128)]
import random
def experts():
    for j in random.sample(range(128), 8):
        torch.matmul(E[j], v)
t = bench(experts, 30)
print(f"cuBLAS 8 x GEMV 1536x2048 (50 MB, 8 launches): {t:.1f} us = {8*1536*2048*2/t/1e3:.0f} GB/s")
