"""Which of stock torch's cuDNN uses work: conv2d fwd+bwd (fp32, bf16), batch norm, bf16 SDPA per backend.

Each case runs in a child process (a crash in one is reported as its signal, the rest still run) and
prints ``ok <case> max_err=..`` against a float64 CPU reference, or ``FAIL <case>: <error>``. On the GPU
host, natively and through rgpu with the server's math-library trace on (one line per forwarded call):

    python tools/diag/probe_torch_cudnn.py
    RGPU_CUDA_LIB_TRACE=1 python -m rgpu intercept run -- python tools/diag/probe_torch_cudnn.py

(the trace is the server's: a local server started by ``intercept run`` inherits it; a separate
``rgpu serve`` needs it in its own environment). ``--one CASE`` runs one case in this process.
"""
from __future__ import annotations

import argparse
import faulthandler
import signal
import subprocess
import sys


def _conv(dtype_name: str, stride: int):
    import torch
    import torch.nn.functional as F
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 17, 17, generator=g, dtype=torch.float64)
    w = torch.randn(8, 3, 3, 3, generator=g, dtype=torch.float64)
    xd, wd = (t.to("cuda", dtype).requires_grad_() for t in (x, w))
    y = F.conv2d(xd, wd, stride=stride, padding=1)
    y.float().square().sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    yr = F.conv2d(xr.to(dtype).double(), wr.to(dtype).double(), stride=stride, padding=1)
    yr.square().sum().backward()
    errs = [(a.detach().double().cpu() - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
            for a, b in ((y, yr), (xd.grad, xr.grad), (wd.grad, wr.grad))]
    return max(errs)


def _bn():
    import torch
    import torch.nn.functional as F
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    xd = x.float().cuda().requires_grad_()
    rm, rv = torch.zeros(3, device="cuda"), torch.ones(3, device="cuda")
    y = F.batch_norm(xd, rm, rv, training=True)
    y.square().sum().backward()
    yr = F.batch_norm(x, torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), training=True)
    return (y.double().cpu() - yr).abs().max().item()


def _sdpa(backend: str | None):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 64, generator=g) for _ in range(3))
    qd, kd, vd = (t.to("cuda", torch.bfloat16).requires_grad_() for t in (q, k, v))
    if backend is None:
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
    else:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
    out.float().sum().backward()
    torch.cuda.synchronize()
    ref = F.scaled_dot_product_attention(*(t.to(torch.bfloat16).double() for t in (q, k, v)), is_causal=True)
    return (out.double().cpu() - ref).abs().max().item()


CASES = {
    "conv2d_fp32_s1": lambda: _conv("float32", 1), "conv2d_fp32_s2": lambda: _conv("float32", 2),
    "conv2d_bf16_s1": lambda: _conv("bfloat16", 1), "conv2d_bf16_s2": lambda: _conv("bfloat16", 2),
    "batch_norm_fp32": _bn,
    "sdpa_bf16_default": lambda: _sdpa(None), "sdpa_bf16_cudnn": lambda: _sdpa("CUDNN_ATTENTION"),
    "sdpa_bf16_flash": lambda: _sdpa("FLASH_ATTENTION"), "sdpa_bf16_efficient": lambda: _sdpa("EFFICIENT_ATTENTION"),
    "sdpa_bf16_math": lambda: _sdpa("MATH"),
}


def one(name: str) -> int:
    import torch
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    faulthandler.enable()
    try:
        err = CASES[name]()
        torch.cuda.synchronize()
    except Exception as exc:                    # what failed, in one line
        print(f"FAIL {name}: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
              flush=True)
        return 1
    print(f"ok {name} max_err={err:.3g}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", choices=sorted(CASES), help="run one case in this process")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per case")
    args = ap.parse_args()
    if args.one:
        return one(args.one)
    failed = 0
    for name in CASES:
        try:
            done = subprocess.run([sys.executable, __file__, "--one", name], timeout=args.timeout,
                                  stdout=subprocess.PIPE, text=True)     # stderr (the trace, faults) passes
        except subprocess.TimeoutExpired:
            print(f"FAIL {name}: no answer in {args.timeout:.0f} s", flush=True)
            failed += 1
            continue
        lines = [x for x in done.stdout.splitlines() if x.startswith(("ok ", "FAIL "))]
        if done.returncode < 0:
            lines = [f"FAIL {name}: killed by {signal.Signals(-done.returncode).name}"]
        print("\n".join(lines) or f"FAIL {name}: exit {done.returncode} (its stderr above)", flush=True)
        failed += done.returncode != 0
    print(f"probe_torch_cudnn: {len(CASES) - failed} of {len(CASES)} ok", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
