"""Train the character-level GPT on the stdlib's sources: ``python examples/nanogpt/train.py --device rgpu``.

Defaults are sized to finish in under 3 minutes on a 2-core machine against the
local (embedded) server; ``--preset bench`` is the 6-layer, 384-wide model of
the performance figures. Writes ``ckpt.pt`` and ``loss.png`` (with matplotlib:
``pip install -e ".[example]"``) into ``--out``; ``--resume`` continues from the
checkpoint there.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import CharData  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

PRESETS = {
    # name: (n_layer, n_head, n_embd, block_size, batch_size)
    "small": (4, 4, 128, 64, 12),
    "bench": (6, 6, 384, 256, 64),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="rgpu", help="rgpu | cpu | cuda (rgpu:N, cuda:N too)")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--sample", type=int, default=200, help="characters to generate at the end (0: none)")
    p.add_argument("--out", default="out/nanogpt")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    p.add_argument("--no-progress", action="store_true")
    for name in ("n_layer", "n_head", "n_embd", "block_size", "batch_size"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help="overrides the preset")
    args = p.parse_args(argv)
    for name, value in zip(("n_layer", "n_head", "n_embd", "block_size", "batch_size"), PRESETS[args.preset]):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay to ``min_lr`` (as nanoGPT)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (args.lr - args.min_lr)


@torch.no_grad()
def evaluate(model, data, args, device, batches: int = 4) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(0)
    total = 0.0
    for _ in range(batches):
        x, y = data.batch("val", args.batch_size, args.block_size, gen)
        total += model(x.to(device), y.to(device))[1].item()
    model.train()
    return total / batches


def save_plot(history: list, evals: list, path: Path) -> bool:
    """The loss curve as a PNG; False (and one line saying how to get it) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(f"no {path.name}: the plot needs matplotlib (pip install matplotlib, or pip install -e \".[example]\")")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s for s, _ in history], [v for _, v in history], lw=0.8, label="train")
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device.startswith("rgpu"):
        import rgpu  # noqa: F401  (registers the device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = CharData()
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout)
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    device = torch.device(args.device)
    model.to(device)
    opt = model.configure_optimizer(args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    start, history, evals = 0, [], []
    ckpt_path = out / "ckpt.pt"
    if args.resume and ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location="cpu")  # load_state_dict moves what belongs on the device
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        gen.set_state(ckpt["generator"])
        start, history, evals = ckpt["step"], ckpt["history"], ckpt["evals"]
        print(f"resumed from {ckpt_path} at step {start}")
    print(f"{model.num_params() / 1e6:.2f} M parameters on {device}; corpus {len(data.train) + len(data.val):,} chars")

    from tqdm import tqdm

    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, disable=args.no_progress, unit="step")
    t0 = time.perf_counter()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = data.batch("train", args.batch_size, args.block_size, gen)
        _, loss = model(x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()
        history.append((step, value))
        bar.set_postfix(loss=f"{value:.3f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evals.append((step + 1, evaluate(model, data, args, device)))
            bar.write(f"step {step + 1}: train {value:.4f}, validation {evals[-1][1]:.4f}")
    elapsed = time.perf_counter() - t0
    done = args.steps - start
    if done > 0:
        print(f"{done} steps in {elapsed:.1f} s ({1000 * elapsed / done:.1f} ms/step)")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "generator": gen.get_state(),
                "step": args.steps, "history": history, "evals": evals, "config": vars(cfg)}, ckpt_path)
    plotted = save_plot(history, evals, out / "loss.png")
    print(f"wrote {ckpt_path}" + (f" and {out / 'loss.png'}" if plotted else ""))
    if args.sample:
        model.eval()
        prompt = torch.tensor([data.encode("def ")], dtype=torch.long, device=device)
        torch.manual_seed(args.seed)
        print(data.decode(model.generate(prompt, args.sample, top_k=20)[0].tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
