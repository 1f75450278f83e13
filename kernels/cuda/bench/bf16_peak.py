# bf16 tensor-core peak of the GPU, the ceiling the prefill figures are divided by:
# torch.matmul 8192^3 on random data, mean of 20 after 5 warm-ups. Prints TFLOP/s (one number).
# Device only (PyTorch is there, never part of the product).
import torch

a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(5):
    a @ b
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda.synchronize()
s.record()
for _ in range(20):
    a @ b
e.record()
torch.cuda.synchronize()
print("%.1f" % (2 * 8192**3 * 20 / (s.elapsed_time(e) * 1e-3) / 1e12))
