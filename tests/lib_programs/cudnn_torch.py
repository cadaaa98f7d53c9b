"""Stock CUDA torch's cuDNN uses, run through rgpu (test_cuda_lib_cudnn_torch.py): conv2d forward and
backward in float32 and bfloat16 (torch's Conv_v8.cpp over cudnn-frontend's backend API, deterministic,
TF32 off), each against the same convolution on the CPU in double rounded once to the dtype; then bf16
SDPA with cuDNN attention forced (cudnn-frontend's graph API) forward. Prints "label value" lines; a
Python error prints "label error <type>: <first line>", so only a crash ends the program early."""
import sys

import torch
import torch.nn.functional as F

torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
torch.backends.cudnn.allow_tf32 = False


def conv(dtype):
    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for s in ((2, 3, 9, 9), (4, 3, 3, 3), (2, 4, 5, 5)))
    xd, wd = x.cuda().requires_grad_(), w.cuda().requires_grad_()
    y = F.conv2d(xd, wd, padding=1, stride=2)
    gx, gw = torch.autograd.grad(y, (xd, wd), dy.cuda())
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    yr = F.conv2d(xr, wr, padding=1, stride=2)
    rx, rw = torch.autograd.grad(yr, (xr, wr), dy.double())
    return max(((a.cpu().double() - b.to(dtype).double()).abs().max() / b.abs().max()).item()
               for a, b in ((y, yr), (gx, rx), (gw, rw)))


def sdpa():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(2, 4, 64, 64).to(torch.bfloat16).cuda() for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.float().abs().max().item()


for label, case in (("conv_fp32", lambda: conv(torch.float32)), ("conv_bf16", lambda: conv(torch.bfloat16)),
                    ("sdpa_cudnn", sdpa)):
    try:
        print(label, f"{case():.3g}", flush=True)
    except Exception as exc:
        print(label, "error", f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}", flush=True)
print("done", flush=True)
sys.exit(0)
