"""The rungs of stock PyTorch's ladder (``cuda_ladder.py`` runs and compares them), the models they train, and how a
result is recorded: each tensor as the sha256 of its bytes and a few floats.

A rung is a function of a ``Rung``; each of its results is ``put(name, fn)``, in its own try/except, with
inputs drawn on the CPU from a generator seeded by the result's name (a failed result never shifts the
inputs of the next) and copied to the device. torch is imported by ``load_torch`` (the comparison needs none).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import time
import traceback
import zlib

torch = nn = F = None
TIMEOUTS = {"R10": 150, "R11": 150}       # the compile rungs' seconds (Inductor and Triton compile cold); others: the caller's


def load_torch():
    """torch, imported once, deterministic: TF32 off, cuDNN deterministic and not benchmarking, torch's
    deterministic algorithms (warnings only: an op without one still runs), seeded."""
    global torch, nn, F
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # what deterministic cuBLAS asks for
    import torch as t
    torch, nn, F = t, t.nn, t.nn.functional
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)   # atomics (flash backward, index_add) would differ run to run
    torch.manual_seed(0)
    return torch


class Skip(Exception):
    """A rung that cannot run here (torchvision absent): recorded as skipped, not failed."""


# ---- results ---------------------------------------------------------------------------------------

def digest(t) -> dict:
    """A tensor's bytes as sha256 (bitwise comparison) and a few floats (tolerance comparison)."""
    t = t.detach().to("cpu").contiguous().reshape(-1)
    raw = t.view(torch.uint8).numpy().tobytes()      # through uint8: bfloat16 has no numpy dtype
    f = t.double()
    fin = f[torch.isfinite(f)]
    return {"sha256": hashlib.sha256(raw).hexdigest(), "dtype": str(t.dtype).removeprefix("torch."), "n": t.numel(),
            "sum": float(fin.sum()), "absmax": float(fin.abs().max()) if fin.numel() else 0.0,
            "first": [float(v) for v in f[:4]], "nonfinite": int(t.numel() - fin.numel())}


def _summarize(value):
    if torch is not None and isinstance(value, torch.Tensor):
        return digest(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, float) for v in value):   # losses
        return dict(digest(torch.tensor(value, dtype=torch.float64)), values=list(value))
    return {"info": value}                   # a number or a word: shown, never compared


def error(exc: BaseException) -> dict:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return {"type": type(exc).__name__, "message": str(exc)[:1500], "traceback": "".join(tb[-4:])[-1500:]}


def _cpu_gen(name: str):
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


class Rung:
    """One rung's results: ``put(name, fn)`` runs ``fn(rnd)`` and stores each tensor it returns, or its error.
    ``rnd(*shape, dtype=...)`` draws from a CPU generator seeded by ``name``, then copies to the device."""

    def __init__(self, dev):
        self.dev, self.results = dev, {}

    def put(self, name: str, fn) -> None:
        gen = _cpu_gen(name)

        def rnd(*shape, dtype=None, grad=False, low=None, high=None):
            t = (torch.randint(low, high, shape, generator=gen) if high is not None
                 else torch.randn(*shape, generator=gen).to(dtype or torch.float32))
            t = t.to(self.dev)
            return t.requires_grad_() if grad else t
        try:
            got = fn(rnd)
            got = got if isinstance(got, dict) else {"": got}
            for key, value in got.items():
                self.results[f"{name}.{key}" if key else name] = _summarize(value)
        except Exception as exc:
            self.results[name] = {"error": error(exc)}


def _backward(rnd, y, **names) -> dict:
    """y.backward of a seeded gradient; y and the gradients of ``names`` (name=tensor) as results."""
    y.backward(rnd(*y.shape, dtype=y.dtype))
    return {"y": y, **{f"d{k}": v.grad for k, v in names.items()}}


# ---- the models --------------------------------------------------------------------------------------

def _models():
    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads, self.ln1, self.ln2 = heads, nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                       for t in self.qkv(self.ln1(x)).split(C, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        """nanoGPT-class: 4 layers, 128 wide, 4 heads, vocabulary 256, block 64, tied head."""

        def __init__(self, vocab=256, block=64, d=128, layers=4, heads=4):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
            self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
            self.head.weight = self.tok.weight

        def forward(self, idx, targets):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            logits = self.head(self.ln(self.blocks(x)))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    def cnn():
        """2 conv + BN + relu + pool, then a linear layer, on 32x32 images, 10 classes."""
        def stage(i, o):
            return [nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(), nn.MaxPool2d(2)]
        return nn.Sequential(*stage(3, 16), *stage(16, 32), nn.Flatten(), nn.Linear(32 * 8 * 8, 10))
    return GPT, cnn


def _state(model):
    """Every floating tensor of the model's state (parameters, BN statistics), as one fp32 vector."""
    return torch.cat([v.detach().float().reshape(-1) for v in model.state_dict().values() if v.is_floating_point()])


def _autocast(dev, dtype):
    return torch.autocast(device_type=dev.type, dtype=dtype) if dtype else contextlib.nullcontext()


def gpt_setup(dev, seed=7, batch=8, block=64, d=128, layers=4, heads=4, capturable=False):
    """The GPT, AdamW and 20 batches of a text it can learn (a 509-token phrase repeated), all made on the CPU
    (R7's shape by default; ``rgpu bench cuda --torch`` times others; ``capturable``: AdamW for a CUDA graph)."""
    GPT, _ = _models()
    torch.manual_seed(seed)
    model = GPT(block=block, d=d, layers=layers, heads=heads)
    for p in model.parameters():             # nanoGPT's init: a first loss near ln(256)
        if p.dim() > 1:
            nn.init.normal_(p, 0.0, 0.02)
    model = model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"capturable": True} if capturable else {}))
    gen = _cpu_gen("gpt-data")
    text = torch.randint(0, 256, (509,), generator=gen).repeat(8)
    starts = torch.randint(0, text.numel() - block - 1, (20, batch), generator=gen)
    batches = [(torch.stack([text[s:s + block] for s in row]).to(dev),
                torch.stack([text[s + 1:s + block + 1] for s in row]).to(dev)) for row in starts.tolist()]
    return model, opt, batches


def train_step(model, opt, x, y, dev, dtype=None):
    with _autocast(dev, dtype):
        loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


# ---- the rungs ---------------------------------------------------------------------------------------

def r4(r: Rung):
    """cuBLAS and cuBLASLt: matmuls (odd shapes, transposed views), Linear fwd+bwd (the bias epilogue), bmm, addmm, mv."""
    for dt, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for m, k, n in ((256, 512, 256), (127, 65, 33), (1, 300, 7), (64, 64, 1000)):
            r.put(f"mm_{tag}_{m}x{k}x{n}", lambda rnd, m=m, k=k, n=n, dt=dt: rnd(m, k, dtype=dt) @ rnd(k, n, dtype=dt))
        r.put(f"mm_{tag}_transposed_views", lambda rnd, dt=dt: rnd(65, 127, dtype=dt).t() @ rnd(33, 65, dtype=dt).t())
        r.put(f"bmm_{tag}", lambda rnd, dt=dt: torch.bmm(rnd(4, 33, 65, dtype=dt), rnd(4, 65, 17, dtype=dt)))
        r.put(f"bmm_{tag}_transposed", lambda rnd, dt=dt: torch.bmm(rnd(4, 65, 33, dtype=dt).transpose(1, 2),
                                                                     rnd(4, 65, 17, dtype=dt)))
        for shape in ((64,), (8, 40)):
            def linear(rnd, dt=dt, shape=shape):
                torch.manual_seed(4)
                lin = nn.Linear(128, 96).to(r.dev, dt)
                x = rnd(*shape, 128, dtype=dt, grad=True)
                return _backward(rnd, lin(x), x=x, w=lin.weight, b=lin.bias)
            r.put(f"linear_{tag}_{'x'.join(map(str, shape))}", linear)
        r.put(f"addmm_{tag}_bias", lambda rnd, dt=dt: torch.addmm(rnd(96, dtype=dt), rnd(64, 128, dtype=dt),
                                                                 rnd(128, 96, dtype=dt)))
    r.put("addmm_fp32_beta_alpha", lambda rnd: torch.addmm(rnd(64, 96), rnd(64, 128), rnd(128, 96), beta=0.5, alpha=2.0))
    r.put("mv_fp32", lambda rnd: rnd(200, 300) @ rnd(300))
    r.put("mv_fp32_transposed", lambda rnd: rnd(300, 200).t() @ rnd(300))
    r.put("matmul_fp32_batched_broadcast", lambda rnd: rnd(3, 5, 40, 24) @ rnd(24, 16))


def r5(r: Rung):
    """cuDNN: conv2d fwd+bwd fp32 and bf16, BatchNorm2d in training (and its running statistics) and in eval."""
    for dt, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for n, c, hw, o, stride, pad in ((4, 3, 32, 8, 1, 1), (2, 8, 17, 16, 2, 0)):
            def conv(rnd, dt=dt, shape=(n, c, hw, hw), o=o, stride=stride, pad=pad):
                x, w, b = rnd(*shape, dtype=dt, grad=True), rnd(o, shape[1], 3, 3, dtype=dt, grad=True), rnd(o, dtype=dt, grad=True)
                return _backward(rnd, F.conv2d(x, w, b, stride=stride, padding=pad), x=x, w=w, b=b)
            r.put(f"conv2d_{tag}_{n}x{c}x{hw}_s{stride}", conv)

    def bn(rnd, train):
        m = nn.BatchNorm2d(8).to(r.dev)
        with torch.no_grad():
            for p in (m.weight, m.bias, m.running_mean):
                p.copy_(rnd(8))
            m.running_var.copy_(rnd(8).abs() + 0.5)
        m.train(train)
        x = rnd(4, 8, 16, 16, grad=True)
        out = _backward(rnd, m(x), x=x, w=m.weight, b=m.bias)
        return out | {"running_mean": m.running_mean, "running_var": m.running_var}
    r.put("batchnorm2d_train_fp32", lambda rnd: bn(rnd, True))
    r.put("batchnorm2d_eval_fp32", lambda rnd: bn(rnd, False))


def r6(r: Rung):
    """bf16 scaled_dot_product_attention fwd+bwd: torch's own choice, then each backend forced."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    forced = {"default": None, "math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    for name, backend in forced.items():
        for causal in (True, False):
            def sdpa(rnd, backend=backend, causal=causal):
                q, k, v = (rnd(2, 4, 128, 64, dtype=torch.bfloat16, grad=True) for _ in range(3))
                with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                    return _backward(rnd, F.scaled_dot_product_attention(q, k, v, is_causal=causal), q=q, k=k, v=v)
            r.put(f"sdpa_bf16_{name}{'_causal' if causal else ''}", sdpa)


def _gpt_losses(r: Rung, name: str, dtype=None):
    def run(rnd):
        model, opt, batches = gpt_setup(r.dev)
        losses = [train_step(model, opt, x, y, r.dev, dtype) for x, y in batches]
        return {"losses": losses, "state": _state(model)}
    r.put(name, run)


def r7(r: Rung):
    """The GPT, 20 AdamW steps, fp32: the losses and the weights after."""
    _gpt_losses(r, "gpt_fp32_adamw")


def r8(r: Rung):
    """The same 20 steps under bf16 autocast."""
    _gpt_losses(r, "gpt_bf16_autocast_adamw", torch.bfloat16)


def r9(r: Rung):
    """The small CNN, 20 SGD steps (momentum) over 4 batches of 16 images: losses and state (BN statistics too)."""
    def run(rnd):
        _, cnn = _models()
        torch.manual_seed(9)
        model = cnn().to(r.dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.003, momentum=0.9)
        data = [(rnd(16, 3, 32, 32), rnd(16, low=0, high=10)) for _ in range(4)]
        losses = []
        for i in range(20):
            x, y = data[i % 4]
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "state": _state(model)}
    r.put("cnn_fp32_sgd", run)


def _mlp(seed, dev):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(dev)


def r10(r: Rung):
    """torch.compile (default mode, Inductor and Triton; ptxas runs on the client): an MLP fwd+bwd, a pointwise
    and reduction chain, a matmul with an epilogue; each with its compile-and-first-run wall time."""
    def mlp(rnd):
        base, t0 = _mlp(10, r.dev), time.perf_counter()
        x = rnd(32, 64, grad=True)
        out = _backward(rnd, torch.compile(base)(x), x=x)
        return out | {"dw0": base[0].weight.grad, "_first_call_s": round(time.perf_counter() - t0, 2)}

    def timed(fn, *args):
        t0 = time.perf_counter()
        return {"y": torch.compile(fn)(*args), "_first_call_s": round(time.perf_counter() - t0, 2)}
    r.put("compiled_mlp_fwd_bwd", mlp)
    r.put("compiled_pointwise_reduction", lambda rnd: timed(lambda x: (x.sin() * 2 + x.cos()).softmax(-1).sum(0), rnd(64, 256)))
    r.put("compiled_matmul_epilogue", lambda rnd: timed(lambda a, b: torch.relu(a @ b + 1.0), rnd(64, 96), rnd(96, 48)))


def r11(r: Rung):
    """CUDA graphs: torch.cuda.graph capture of an MLP fwd+bwd replayed on new inputs; torch.compile reduce-overhead."""
    def graph(rnd):
        model, x, t = _mlp(11, r.dev), rnd(32, 64), rnd(32, 64)
        inputs = [rnd(32, 64) for _ in range(3)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):               # warm-up off the capture, as torch's docs require
                model.zero_grad(set_to_none=True)
                ((model(x) - t) ** 2).mean().backward()
        torch.cuda.current_stream().wait_stream(side)
        model.zero_grad(set_to_none=True)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            loss = ((model(x) - t) ** 2).mean()
            loss.backward()
        out = {}
        for i, new in enumerate(inputs):
            x.copy_(new)
            g.replay()
            out[f"loss_{i}"], out[f"dw0_{i}"] = loss.clone(), model[0].weight.grad.clone()
        return out

    def reduce_overhead(rnd):
        m = torch.compile(_mlp(12, r.dev), mode="reduce-overhead")
        with torch.no_grad():
            return {f"y_{i}": m(rnd(32, 64)).clone() for i in range(4)}
    r.put("cuda_graph_mlp_fwd_bwd", graph)
    r.put("compiled_reduce_overhead_mlp", reduce_overhead)


def r12(r: Rung):
    """torchvision's ResNet-18, one SGD training step, batch 8 of 64x64."""
    try:
        import torchvision
    except ImportError as exc:
        raise Skip(f"torchvision does not import: {exc}") from exc

    def step(rnd):
        torch.manual_seed(12)
        model = torchvision.models.resnet18(num_classes=10).to(r.dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        loss = F.cross_entropy(model(rnd(8, 3, 64, 64)), rnd(8, low=0, high=10))
        loss.backward()
        grad = model.conv1.weight.grad.clone()
        opt.step()
        return {"loss": loss.detach(), "conv1_grad": grad, "state": _state(model)}
    r.put("resnet18_sgd_step", step)


RUNGS = {"R4": r4, "R5": r5, "R6": r6, "R7": r7, "R8": r8, "R9": r9, "R10": r10, "R11": r11, "R12": r12}
