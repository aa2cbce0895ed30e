"""A small causal LM in ``bf16-true`` with k ramping from 16 to 64: the window's sum in bf16 or in float32.

A ``transformers`` GPT-2 built from a config (no download), two layers of width 64, learns synthetic token
sequences (a random Markov chain over 64 tokens, each token followed by one of 4 likely successors: the loss
falls from ln 64 = 4.16 toward the lowest reachable, about 1.3) in micro-batches of 2 sequences, with
``AccumulationScheduler(Ramp(16, 64, over=steps, unit="step"))`` and AdamW. It is trained three times from
the same initial weights on the same micro-batches in the same order:

* ``precision="32-true"``: the reference;
* ``precision="bf16-true"``: the parameters, their ``.grad`` and so the window's sum of k micro-batch gradients
  are bf16, rounded at every add;
* ``precision="bf16-true"`` with ``grad_accum_dtype=torch.float32``: each micro-batch's bf16 gradient is added
  into a float32 buffer, and the window's mean is rounded to bf16 once, when the optimizer gets it.

Both bf16 runs keep bf16 parameters, bf16 forward and backward passes and a bf16 AdamW step (its moments and
its update are bf16, as under any ``-true`` precision): the option changes the window's sum alone. The script
prints each run's loss and its parameters' relative distance to the 32-true run's, ``|w - w32| / |w32|``,
during training and at the end. At a few steps it also measures the window gradient the optimizer gets against
two references computed at that run's own weights from the window's own micro-batches: the float64 mean of the
micro-batch gradients as the run computes them (bf16 passes): the error of the sum alone, beside the error of
rounding that mean to bf16 once; and the float64 mean of the micro-batch gradients computed in float32 from the
same weights (the gradient a 32-true pass would give there): the sum's error plus the bf16 passes' own. It
writes ``bf16_window.png`` into ``--out``.

What it shows: with the option the window's gradient is within one rounding of its exact mean at every k;
without it the error grows with k (about 2.5x one rounding at k = 16, 5.5x at k = 63). Yet the two bf16 runs'
losses and distances to the 32-true run coincide: at these k the sum's error is a small, unbiased one (under
1 %) beside what the bf16 parameters, passes and optimizer step do, which is what separates bf16-true from
32-true here; the two bf16 runs end nearer each other than either is to the 32-true run.

    pip install -e ".[examples]" && python examples/bf16_window.py     # 40 steps, under a minute on one core
    python examples/bf16_window.py --steps 300 --probes 8                # the docs' figure (4 minutes of one core)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_accum import AccumulationScheduler, Ramp

from _quiet import quiet

try:
    import transformers
except ImportError as error:  # pragma: no cover - the message is the point
    raise SystemExit('This example needs transformers: pip install -e ".[examples]"') from error

VOCAB, LENGTH, MICRO = 64, 32, 2  # tokens, tokens per sequence, sequences per micro-batch
K_START, K_END = 16, 64  # micro-batches per window: the ramp's ends
RUNS = {  # name: (precision, grad_accum_dtype)
    "32-true": ("32-true", None),
    "bf16-true": ("bf16-true", None),
    "bf16-true + float32 sum": ("bf16-true", torch.float32),
}


def make_sequences(count: int, seed: int) -> tuple[Tensor, float]:
    """``count`` sequences of ``LENGTH`` tokens from a random Markov chain (the first token uniform): each token
    is followed by one of 4 successors of its own (random weights), so the next token is predictable from the
    last one. Also the lowest loss per predicted token a model can reach on them: the mean, over the predicted
    positions, of the entropy of the next token given the previous one."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.rand(VOCAB, VOCAB, generator=g).argsort(dim=1)[:, :4]
    weights = torch.zeros(VOCAB, VOCAB).scatter_(1, successors, torch.rand(VOCAB, 4, generator=g) + 0.25)
    transitions = weights / weights.sum(dim=1, keepdim=True)
    tokens = torch.empty(count, LENGTH, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (count,), generator=g)
    for t in range(1, LENGTH):
        tokens[:, t] = torch.multinomial(transitions[tokens[:, t - 1]], 1, generator=g).squeeze(1)
    p = transitions.double()
    entropy = -(p * p.clamp_min(1e-300).log()).sum(dim=1)  # (of each token's successor)
    previous, lowest = torch.full((VOCAB,), 1.0 / VOCAB, dtype=torch.float64), 0.0  # (the token before a prediction)
    for _ in range(LENGTH - 1):
        lowest += float(previous @ entropy) / (LENGTH - 1)
        previous = previous @ p
    return tokens, lowest


def make_model() -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # (deterministic passes: a gradient can be recomputed)
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def flat(tensors: Any) -> Tensor:
    return torch.cat([t.detach().double().reshape(-1) for t in tensors])


def relative(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm())


class CausalLM(pl.LightningModule):
    """Records, before each optimizer step, the weights the step starts from (every ``every`` steps), and at the
    ``probes`` steps the window gradient's errors (see the module's docstring)."""

    def __init__(self, lr: float, every: int, probes: set[int]) -> None:
        super().__init__()
        self.model = make_model()
        self.lr, self.every, self.probes = lr, every, probes
        self.window: list[Tensor] = []  # the open window's micro-batches
        self.weights: dict[int, Tensor] = {}  # optimizer steps done: the parameters then
        self.errors: dict[int, dict[str, float]] = {}

    @override
    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        self.window.append(batch)
        return self.model(input_ids=batch, labels=batch).loss  # (the mean over the micro-batch's tokens)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # (the LightningModule's hook runs after every callback's: `.grad` is the window's gradient as stepped)
        step = self.trainer.global_step
        if step % self.every == 0:
            self.weights[step] = flat(self.parameters()).float()
        if step in self.probes:
            self.errors[step] = self.probe()
        self.window = []

    @override
    def on_train_end(self) -> None:
        self.weights[self.trainer.global_step] = flat(self.parameters()).float()

    def window_mean(self, dtype: torch.dtype) -> Tensor:
        """The float64 mean of the window's micro-batch gradients, each computed in ``dtype`` from a copy of the
        current weights (cast to ``dtype``), its loss undivided."""
        with torch.random.fork_rng():  # (the run's random state untouched)
            copy = make_model()
        copy.load_state_dict(self.model.state_dict())
        copy.to(dtype)
        total = torch.zeros(sum(p.numel() for p in copy.parameters()), dtype=torch.float64)
        plugin = self.trainer.precision_plugin
        for batch in self.window:
            copy.zero_grad(set_to_none=True)
            if dtype == torch.float32:
                loss = copy(input_ids=batch, labels=batch).loss
            else:
                with plugin.forward_context():  # (as the run's own passes: bf16 the default dtype)
                    loss = copy(input_ids=batch, labels=batch).loss
            loss.backward()
            total += flat(p.grad for p in copy.parameters())
        return total / len(self.window)

    def probe(self) -> dict[str, float]:
        stepped = flat(p.grad for p in self.parameters())
        dtype = next(self.parameters()).dtype
        fp32 = self.window_mean(torch.float32)
        errors = {"vs_fp32": relative(stepped, fp32)}
        if dtype != torch.float32:
            own = self.window_mean(dtype)
            errors |= {
                "sum": relative(stepped, own),
                "once": relative(own.to(dtype).double(), own),  # the exact mean, rounded to bf16 once
                "passes": relative(own, fp32),  # the bf16 passes' own error, whatever the sum
            }
        return errors


class Windows(pl.Callback):
    """Each window's k and loss."""

    def __init__(self) -> None:
        self.k: list[int] = []
        self.loss: list[float] = []

    def on_window_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, window: Any) -> None:
        self.k.append(window.k)
        self.loss.append(float(window.loss))


def train(
    precision: str, dtype: torch.dtype | None, data: Tensor, steps: int, lr: float, every: int, probes: set[int]
) -> tuple[CausalLM, Windows]:
    model = CausalLM(lr, every, probes)
    windows = Windows()
    accumulation = AccumulationScheduler(Ramp(K_START, K_END, over=steps, unit="step"), grad_accum_dtype=dtype)
    trainer = pl.Trainer(
        accelerator="cpu",
        precision=precision,  # type: ignore[arg-type]
        max_steps=steps,
        callbacks=[accumulation, windows],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=sys.stderr.isatty(),
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=MICRO))  # type: ignore[arg-type]
    return model, windows


def smoothed(values: list[float], width: int) -> list[float]:
    """The mean of each value and the ``width - 1`` before it (fewer at the start)."""
    return [sum(values[max(0, i - width + 1) : i + 1]) / len(values[max(0, i - width + 1) : i + 1])
            for i in range(len(values))]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40; the docs' run: 300)")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW's learning rate (default 2e-3)")
    parser.add_argument(
        "--probes",
        type=int,
        default=4,
        help="steps at which the window gradient is measured (default 4; the docs' run: 8)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "images")
    args = parser.parse_args()
    quiet()
    transformers.logging.set_verbosity_error()  # (its config notices)
    torch.set_num_threads(1)  # (a model this small mostly waits on a second thread)

    data, lowest = make_sequences(args.steps * K_END * MICRO, seed=0)  # (enough for every window)
    every = max(1, args.steps // 100)
    probes = sorted({round(i * (args.steps - 1) / max(1, args.probes - 1)) for i in range(args.probes)})
    print(f"GPT-2, 2 layers of width 64 ({sum(p.numel() for p in make_model().parameters())} parameters); "
          f"{args.steps} optimizer steps, k = {K_START} -> {K_END} micro-batches of {MICRO} sequences of {LENGTH} "
          f"tokens; AdamW, lr {args.lr}; the lowest loss reachable: {lowest:.3f} nats per token")  # fmt: skip

    results = {name: train(precision, dtype, data, args.steps, args.lr, every, set(probes))
               for name, (precision, dtype) in RUNS.items()}  # fmt: skip
    models = {name: model for name, (model, _) in results.items()}
    losses = {name: windows.loss for name, (_, windows) in results.items()}
    ks = results["32-true"][1].k
    reference = models["32-true"].weights
    plain, wide = models["bf16-true"].weights, models["bf16-true + float32 sum"].weights
    distances = {
        "bf16-true": {s: relative(w.double(), reference[s].double()) for s, w in plain.items()},
        "bf16-true + float32 sum": {s: relative(w.double(), reference[s].double()) for s, w in wide.items()},
    }
    between = {s: float((plain[s].double() - wide[s].double()).norm() / reference[s].double().norm()) for s in plain}

    print("\neach window's loss per token; the bf16 runs: (their parameters' relative distance to the 32-true run's)")
    shown = sorted(reference)[:: max(1, len(reference) // 8)][1:]
    for step in shown + ([args.steps] if shown[-1:] != [args.steps] else []):
        line = f"  step {step:>4} (k {ks[step - 1]:>2}):"
        for name, loss in losses.items():
            line += f"  {name} {loss[step - 1]:.3f}" + (f" ({distances[name][step]:.2e})" if name in distances else "")
        print(line)
    last = max(1, args.steps // 10)
    print(f"\nmean loss over the last {last} steps; the final parameters' relative distance to the 32-true run's:")
    for name, loss in losses.items():
        tail = f", distance {distances[name][args.steps]:.3e}" if name in distances else ""
        print(f"  {name:<24} loss {sum(loss[-last:]) / last:.4f}{tail}")
    print(f"  the two bf16 runs' parameters differ by {between[args.steps]:.3e} (relative to the 32-true run's)")

    print("\nthe window gradient the optimizer got, relative error against: the float64 mean of the window's "
          "micro-batch gradients as the run computes them ('sum'; 'once': that mean rounded to bf16 once), and the "
          "float64 mean of the micro-batch gradients computed in float32 at the same weights ('vs float32'; 'passes': "
          "the exact mean of the bf16 gradients against it, what no sum removes)")  # fmt: skip
    for step in probes:
        errors = {name: model.errors[step] for name, model in models.items()}
        line = f"  step {step + 1:>4} (k {ks[step]:>2}): 32-true vs float64 {errors['32-true']['vs_fp32']:.1e}"
        for name in ("bf16-true", "bf16-true + float32 sum"):
            e = errors[name]
            line += f"; {name}: sum {e['sum']:.1e} (once {e['once']:.1e}), vs float32 {e['vs_fp32']:.1e} (passes " \
                    f"{e['passes']:.1e})"  # fmt: skip
        print(line)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(RUNS, ("C0", "C1", "C2"), strict=True))
    lines: dict[str, dict[str, Any]] = {  # (the two bf16 runs' curves lie one on the other: drawn so both show)
        "32-true": {"linewidth": 1},
        "bf16-true": {"linewidth": 2.5, "alpha": 0.6},
        "bf16-true + float32 sum": {"linewidth": 1, "linestyle": "--"},
    }
    fig, ((ax_loss, ax_gap), (ax_distance, ax_error)) = plt.subplots(2, 2, figsize=(12, 7.5))
    width = max(1, args.steps // 30)
    mean_of = f" (mean of {width} steps)" if width > 1 else ""
    for name, loss in losses.items():
        ax_loss.plot(range(1, len(loss) + 1), smoothed(loss, width), label=name, color=colors[name], **lines[name])
        gap = [a - b for a, b in zip(loss, losses["32-true"], strict=True)]
        ax_gap.plot(range(1, len(loss) + 1), smoothed(gap, width), label=name, color=colors[name], **lines[name])
    ax_loss.axhline(lowest, color="gray", linestyle="--", linewidth=0.8, label="the lowest reachable")
    ax_loss.set(xlabel="optimizer step", ylabel="window loss per token" + mean_of, title="loss", yscale="log")
    ax_loss.legend()
    ax_gap.set(xlabel="optimizer step", ylabel="loss - the 32-true run's" + mean_of, title="loss against 32-true")
    ax_gap.legend()
    for name, curve in distances.items():
        steps = sorted(curve)
        ax_distance.plot(steps, [curve[s] for s in steps], label=name, color=colors[name], **lines[name])
    steps = sorted(between)[1:]  # (the two bf16 runs start from the same weights)
    ax_distance.plot(steps, [between[s] for s in steps], "--", color="gray", linewidth=1,
                     label="the two bf16 runs, one to the other")  # fmt: skip
    ax_distance.set(xlabel="optimizer step (parameters after it)", ylabel="|w - w32| / |w32|", yscale="log",
                    title="parameters' relative distance to the 32-true run's")  # fmt: skip
    ax_distance.legend()
    probed = [ks[s] for s in probes]
    for name, marker in (("bf16-true", "o"), ("bf16-true + float32 sum", "s")):
        errors = [models[name].errors[s] for s in probes]
        ax_error.plot(probed, [e["sum"] for e in errors], marker + "-", color=colors[name], linewidth=1,
                      label=f"{name}: against its exact mean")  # fmt: skip
        ax_error.plot(probed, [e["vs_fp32"] for e in errors], marker + ":", color=colors[name], linewidth=1,
                      label=f"{name}: against float32 passes")  # fmt: skip
    once = [models["bf16-true + float32 sum"].errors[s]["once"] for s in probes]
    ax_error.plot(probed, once, "--", color="gray", linewidth=2, alpha=0.6, label="the exact mean rounded to bf16 once")
    ax_error.set(xlabel="k of the measured window", ylabel="relative error", yscale="log",
                 title="the window gradient the optimizer got")  # fmt: skip
    ax_error.set_ylim(top=3 * max(e["vs_fp32"] for model in models.values() for e in model.errors.values()))
    ax_error.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"GPT-2 (2 x 64), k = {K_START} -> {K_END} micro-batches of {MICRO}, AdamW lr {args.lr}: 32-true, "
                 "bf16-true, bf16-true with grad_accum_dtype=torch.float32")  # fmt: skip
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bf16_window.png"
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
