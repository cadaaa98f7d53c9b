"""The native side of ``rgpu bench train`` and of the GPU check's correctness step: a process that never imports rgpu
(unless told to run the step on ``device="rgpu"``: a session of its own, for benches that compare two sessions).

Why a process of its own: once a PrivateUse1 backend is registered (``import
rgpu`` does it), ``at::getAccelerator()`` answers PrivateUse1, and CUDA
autograd in that process fails in the engine (``opt_ready_stream &&
opt_parent_stream INTERNAL ASSERT FAILED at engine.cpp``, PyTorch issue
#161129). So the native CUDA (or CPU) reference runs here, with the same
model code (``examples/nanogpt/model.py``), the same init (``manual_seed(0)``)
and the same batches (``make_batches``) as the rgpu side.

    python bench/native_step.py        # driven by ``Native`` below over stdin/stdout, one JSON object a line

Requests: ``{"setup": {preset, vocab, device, tf32[, compile: true or a mode]}}``, ``{"warm": n}`` (losses of
the first n batches), ``{"block": steps}`` (ms per step), ``{"trace": steps}`` (ms per step of wall and of GPU
work, under torch.profiler), ``{"quit": true}``.
This file imports torch and the model only; a test asserts rgpu stays out.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NANOGPT = HERE.parent / "examples" / "nanogpt"


def make_batches(torch, vocab: int, batch: int, block: int, n: int = 4) -> list:
    """The benchmark's batches (inputs double as targets), the same in every process."""
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (batch, block), generator=gen),) * 2 for _ in range(n)]


def _serve() -> int:
    sys.path[:] = [d for d in sys.path if Path(d or ".").resolve() != HERE]  # bench/ holds cuda.py, ops.py...
    import torch

    if str(NANOGPT) not in sys.path:
        sys.path.insert(0, str(NANOGPT))
    from model import GPT, GPTConfig

    state: dict = {}

    def step(x, y):
        dev = state["device"]
        _, loss = state["model"](x.to(dev), y.to(dev))
        state["opt"].zero_grad(set_to_none=True)
        loss.backward()
        state["opt"].step()
        return loss.item()

    for line in sys.stdin:
        req = json.loads(line)
        if "setup" in req:
            s = req["setup"]
            p, dev = s["preset"], s["device"]
            if dev == "rgpu":   # a session of its own (RGPU_SERVER and the rest from this process's environment)
                import rgpu  # noqa: F401
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(s.get("tf32"))
            torch.manual_seed(0)
            cfg = GPTConfig(vocab_size=s["vocab"], block_size=p["block_size"], n_layer=p["n_layer"],
                            n_head=p["n_head"], n_embd=p["n_embd"], dropout=0.0)
            model = GPT(cfg).to(dev)
            opt = model.configure_optimizer(3e-4)
            mode = s.get("compile")
            if mode:  # native torch.compile (Inductor), the same mode: the reference for rgpu's compiled step
                model = torch.compile(model, mode=None if mode in (True, "default") else mode)
            state.update(device=dev, model=model, opt=opt,
                         batches=make_batches(torch, s["vocab"], p["batch"], p["block_size"], s.get("batches", 4)))
            reply = {"device": dev, "torch": torch.__version__, "rgpu_imported": "rgpu" in sys.modules}
            if dev == "rgpu":   # what carries the session (a resumable one is ResumingTransport)
                from rgpu.device_backend import session

                reply["transport"] = type(session.current().conn.transport).__name__
        elif "warm" in req:
            reply = {"losses": [step(*b) for b in state["batches"][:req["warm"]]]}
        elif "block" in req:
            sync = torch.cuda.synchronize if state["device"].startswith("cuda") else (lambda: None)
            n, batches = req["block"], state["batches"]
            sync()
            t0 = time.perf_counter()
            for i in range(n):
                step(*batches[i % len(batches)])
            reply = {"ms": (time.perf_counter() - t0) / n * 1e3}
        elif "trace" in req:  # the GPU's busy time per step under torch.profiler (``--trace``'s reference)
            reply = _gpu_busy(torch, step, state["batches"], req["trace"])
        else:
            return 0
        print(json.dumps(reply), flush=True)
    return 0


def _gpu_busy(torch, step, batches: list, n: int) -> dict:
    """ms per step: wall, and the union of the GPU's kernels, copies and memsets (``timeline``'s measure)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("timeline", HERE / "timeline.py")  # not through rgpu's package
    timeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timeline)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for i in range(n):
            step(*batches[i % len(batches)])
        wall = (time.perf_counter() - t0) / n * 1e3
    events = json.loads(timeline.export(prof))["traceEvents"]
    return {"wall": wall, "gpu_busy": timeline.gpu_busy(events) / n}


class Native:
    """The parent's handle on a ``native_step`` process."""

    def __init__(self, device: str, preset: dict, vocab: int, tf32: bool = False, batches: int = 4,
                 compile: bool | str = False, env: dict | None = None):
        env = {k: v for k, v in (os.environ if env is None else env).items() if k != "PYTHONSTARTUP"}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._ask(setup=dict(preset=preset, vocab=vocab, device=device, tf32=tf32, batches=batches,
                                         compile=compile))
        if self.info.get("rgpu_imported") and device != "rgpu":
            raise RuntimeError("the native reference process imported rgpu; its CUDA autograd would fail")

    def _ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the native reference process ended (exit {self.proc.wait()}); its error is above")
        return json.loads(line)

    def warm(self, n: int) -> list[float]:
        return self._ask(warm=n)["losses"]

    def block(self, steps: int) -> float:
        return self._ask(block=steps)["ms"]

    def trace(self, steps: int) -> dict:
        return self._ask(trace=steps)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._ask(quit=True)
            except (RuntimeError, OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    raise SystemExit(_serve())
