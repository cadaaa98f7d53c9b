"""``rgpu bench generate``: greedy generation (Hugging Face ``generate``, KV cache) on rgpu beside the same loop native.

    rgpu bench generate --json [--tokens 128] [--repeats 5]        (harness)
    rgpu bench generate --quick --json                              (CI: a tiny config)
    python -m rgpu.bench.generate --json --quick                    (standalone)

Model: GPT-2 small's shape (12 layers, 768 wide, 12 heads, 50257 tokens, 124 M parameters), random
init from a ``GPT2Config`` under ``torch.manual_seed(0)``, nothing downloaded; ``--quick``: 2 layers,
64 wide, a vocabulary of 1000, 16 new tokens, 3 runs. Prompt: 16 random tokens per sequence (a fixed
seed), all attended; batch 1 and batch 8; ``do_sample=False``, ``use_cache=True``,
``max_new_tokens`` = ``--tokens`` (128), GPT-2's end-of-text token as eos and pad.

Native = the same model (the same init) and the same loop on the server's kind of device in this
process (CUDA on a GPU host, else the CPU), TF32 as ``RGPU_TF32`` on both sides; one run is one
``generate`` and the ``.cpu()`` of its tokens; rgpu and native runs alternate (``harness.compare``),
each figure the median, ``spread`` [min, max]. Tokens/s counts the new positions of the whole batch.

Every run's tokens are compared with native's: ``tokens_equal`` in each row, and a banner on stderr
when any differ. Then one more ``generate`` each of N tokens and of 1 token under ``rgpu.stats()``:
messages and round trips per new token, and the loop's own share, ``(N-token - 1-token) / (N - 1)``.
"""
from __future__ import annotations

import copy
import sys
import time

from rgpu.bench import harness
from rgpu.errors import ConfigError, RgpuError

PROMPT = 16      # prompt tokens per sequence
BATCHES = (1, 8)
PRESETS = {"gpt2-small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
           "tiny": dict(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=256,
                        bos_token_id=999, eos_token_id=999)}
FLAGS = {"--tokens": {"type": int, "default": None, "help": "new tokens per sequence (128; --quick: 16)"}}
MISSING = "rgpu bench generate needs Hugging Face transformers, which is not installed: pip install transformers"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError(MISSING) from None
    return transformers


def model_for(preset: str):
    """The preset's model, random init under a fixed seed, on the CPU, in eval mode."""
    import torch

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**PRESETS[preset])).eval()


def prompt(batch: int, vocab: int):
    import torch

    return torch.randint(0, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))


def generate(model, ids, device: str, tokens: int):
    """One greedy generation on ``device``: the tokens (prompt and new), on the CPU."""
    import torch

    x = ids.to(device)
    eos = model.config.eos_token_id
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, do_sample=False,
                             use_cache=True, eos_token_id=eos, pad_token_id=eos)
    return out.cpu()


def rows(args=None) -> list[dict]:
    transformers = _transformers()
    import torch

    import rgpu
    from rgpu import config
    from rgpu.device_backend import session

    rgpu.register()  # the rgpu command loaded rgpu as a parent, which registers nothing
    quick = getattr(args, "quick", False)
    preset = "tiny" if quick else "gpt2-small"
    tokens = getattr(args, "tokens", None) or (16 if quick else 128)
    repeats = 3 if quick else harness.repeats_of(args)
    native = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = config.settings().tf32
    model = model_for(preset)
    params = sum(p.numel() for p in model.parameters())
    models = {"rgpu": copy.deepcopy(model).to("rgpu"), native: model.to(native)}
    server = session.get().kind
    common = dict(batch=None, new_tokens=tokens, preset=preset, params=params, server=server,
                  transformers=transformers.__version__)
    out = []
    for batch in BATCHES:
        ids = prompt(batch, model.config.vocab_size)
        reference = generate(models[native], ids, native, tokens)   # warm both sides; native's tokens are the reference
        got = [generate(models["rgpu"], ids, "rgpu", tokens)]
        new = (reference.shape[1] - PROMPT) * batch

        def run(dev: str):
            def once() -> float:
                t0 = time.perf_counter()
                tokens_out = generate(models[dev], ids, dev, tokens)
                seconds = time.perf_counter() - t0
                if dev == "rgpu":
                    got.append(tokens_out)
                return new / seconds
            return once

        result = harness.compare(run("rgpu"), run(native), repeats)
        equal = all(torch.equal(g, reference) for g in got)
        if not equal:
            _shout(batch, got, reference)
        where = {**common, "batch": batch, "tokens_equal": equal}
        transport = rgpu.stats()["transport"]
        out.append(harness.row("generate", transport, f"greedy generation, batch {batch} ({preset})", None,
                               result, f"{native} native (this process)", unit="tokens/s", **where))
        out.extend(_trips(models["rgpu"], ids, tokens, transport, where))
    return out


def _trips(model, ids, tokens: int, transport, where: dict) -> list[dict]:
    """Messages and round trips per new token over one generation, and the decode loop's own share."""
    import rgpu

    counts = {}
    for n in (tokens, 1):
        rgpu.stats(reset=True)
        generate(model, ids, "rgpu", n)
        counts[n] = rgpu.stats()
    whole, one = counts[tokens], counts[1]
    loop = max(tokens - 1, 1)
    batch = where["batch"]

    def trip_row(metric, value, baseline_name, baseline, **extra):
        return {"bench": "generate", "transport": transport, "metric": f"{metric}, batch {batch}", "unit": "count",
                "size": None, "value": value, "baseline_name": baseline_name, "baseline": baseline,
                "ratio": value / baseline if baseline else None, "spread": None, **where, **extra}

    return [
        trip_row("round trips per new token", whole["round_trips"] / tokens, "expected (the stopping check)", 1.0,
                 round_trips=whole["round_trips"], round_trips_one_token=one["round_trips"]),
        trip_row("round trips per new token in the decode loop", (whole["round_trips"] - one["round_trips"]) / loop,
                 "expected (the stopping check)", 1.0),
        trip_row("messages per new token", whole["messages"] / tokens, None, None, messages=whole["messages"],
                 messages_one_token=one["messages"]),
    ]


def _shout(batch: int, got: list, reference) -> None:
    """Generated tokens that differ from native's: a banner on stderr, never only a field in the JSON."""
    import torch

    bad = next(g for g in got if not torch.equal(g, reference))
    first = int((bad != reference).any(0).nonzero()[0]) - PROMPT if bad.shape == reference.shape else None
    bar = "!" * 78
    print(f"\n{bar}\nrgpu bench generate: batch {batch}: rgpu's tokens DIFFER from native's "
          f"({sum(not torch.equal(g, reference) for g in got)} of {len(got)} runs; "
          f"first differing new token: {first})\n{bar}\n", file=sys.stderr)


def main(argv=None) -> int:
    try:
        return harness.main(rows, argv, __doc__, flags=FLAGS)
    except RgpuError as exc:
        print(f"rgpu: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
