"""One fuzzed configuration: what a user combines, as plain JSON-able data, and its generator.

Nothing here imports Lightning or ``lightning_accum``: the reference reads a ``Config`` as the
docs define each option, the package runner turns it into the package's objects.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

# hooks where an injected failure is resumed from `OnExceptionCheckpoint` (the package leaves the
# window out, and the case falls back to the last step checkpoint, where that cannot be exact)
FAILURES = (
    "on_train_batch_start",
    "training_step",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "validation",
    "sigterm",
)
# interruptions whose resumed run does not run a forward again: before the batch's forward, or once it is processed
FORWARD_ONCE = ("save", "on_train_batch_start", "training_step", "on_train_batch_end", "sigterm")
LAMBDAS = ("cycle3", "epoch_up", "samples_tier")
NOISE_OPTIONS = ("start", "every", "warmup", "hysteresis", "beta", "max_ratio")  # `NoiseScale`'s keyword arguments


@dataclasses.dataclass
class Config:
    seed: int = 0
    adapter: str = "callback"  # "callback" | "mixin" | "fabric"
    # the mixin: "backward" | "each" | "heads" | "microbatches" | "cached" | "items_int" (acc.backward(mean, items=int))
    mode: str = "backward"
    # "cached": two towers of different sizes (the first two tokens of each sample, then every other token on
    # its own), keyword inputs, `get_rep`; their chunk sizes
    chunks: list[int | None] = dataclasses.field(default_factory=lambda: [2, 2])
    # and with these (issue 32): the loss in blocks of `loss_chunk` samples (the first tower's rows); chunks
    # packed up to `chunk_tokens` tokens a tower by the mask (its padding trimmed; a chunk size of None: no
    # row cap); a `guide` tower (the fuzzer's net at another seed) whose sigmoid weights each token's error,
    # run once: "frozen" (its parameters without grad) or "no_grad" (the flag)
    loss_chunk: int | None = None
    chunk_tokens: list[int | None] | None = None
    guide: str | None = None
    n: int = 24  # samples
    batch_size: int = 4
    epochs: int = 2
    limit_train_batches: int | None = None
    max_steps: int = -1
    schedule: dict[str, Any] = dataclasses.field(default_factory=lambda: {"family": "constant", "k": 2})
    normalize: str = "mean"
    reduction: str = "sum"  # with normalize="items": what the loss is over a micro-batch's items
    # the mixin with reduction="mean" (issue 35): a mean's weight given by "items" (`acc.backward(mean, items=n)`,
    # the modes "backward" and "items_int"), or by the mixin's `reduction="mean"` ("reduction": every mode passes
    # mean losses, weighted by `count(batch)`, or `count(part)` in "microbatches"); the reference is the same sum
    mean_by: str = "items"
    count: bool = False  # whether `count=` is given (always with "items")
    empty_batches: list[int] = dataclasses.field(default_factory=list)  # batch indices whose samples hold no item
    optimizer: str = "sgd"  # "sgd" | "momentum" | "adam"
    optimizers: int = 1  # the mixin: 2 optimizers in one window, the first layer's and the last's
    shared: bool = False  # with 2: the first also holds the last layer's bias
    lr: float = 0.1
    clip: list[Any] | None = None  # [value, "norm" | "value"]
    lr_scaling: str | None = None
    lr_schedule: dict[str, Any] | None = None  # {"warmup", "total", "unit", "final"} of WarmupCosine
    scheduler: dict[str, Any] | None = None  # {"kind": "step", "interval", "step_size"} | {"kind": "plateau"}
    decay: list[Any] | None = None  # [factor, "sum" | "ema", bias_correction]
    val_every: int | None = None  # validation every n training batches (inside windows)
    interruptions: list[list[Any]] = dataclasses.field(default_factory=list)  # [kind, epoch, batch]; "save" or a hook
    # "model_checkpoint", "lr_monitor", "early_stopping", "ema" (a user's average of the parameters at window ends),
    # "progress_bar" (one that draws nothing)
    callbacks: list[str] = dataclasses.field(default_factory=list)
    monitor: str = "probe"  # what EarlyStopping and ReduceLROnPlateau watch: "probe" (logged) or "accum/loss"
    swa: list[float] | None = None  # StochasticWeightAveraging: [swa_lrs, swa_epoch_start (from 1: epoch 0)]
    # the Fabric loop: backward passes per micro-batch (its loss split over its tokens), whether each checkpoint
    # is saved again right after it is loaded (before the next block), whether `accumulate` gets `epoch=`
    passes: int = 1
    resave: bool = False
    epoch_arg: bool = True
    last_arg: bool = False  # whether the epoch's last `accumulate` gets `last=True` (else `flush` closes it)
    # issue 52: under a `Budget`, the mixin's `configure_accumulation(read_ahead=True)`, or the Fabric loop iterating
    # `acc.read_ahead(batches)` (started again after each resume, from the next batch)
    read_ahead: bool = False
    # the multi-process part (`ranks.py`): processes, each taking every `world`-th batch, and their strategy
    world: int = 1
    strategy: str = "ddp"  # "ddp" | "fsdp2"
    # the mixin: who steps the LR scheduler: "package" (`step_schedulers=True`), "user" (the model, as in Lightning's
    # manual optimization: after the block when `acc.last`, or in `on_train_epoch_end`), "both" (refused)
    schedulers_by: str = "package"
    probe_in: str = "callback"  # where the probe is logged at each epoch's end: a "callback" or the "module" (after it)
    windows: str = "shared"  # the mixin's 2 optimizers: one "shared" window, or "each" its own, one after the other
    skip: list[int] = dataclasses.field(default_factory=list)  # batches (each epoch) trained by no block (the mixin)
    # or whose `training_step` returns `None` (the callback)
    # issue 53: the skipped batches run their forward first (the callback: in `training_step`, its first piece with
    # `microbatch_size`; the mixin: in a block that makes no backward pass), which under `batchnorm="window"` counts
    # once in its window's statistics
    skip_forward: bool = False
    plain: bool = False  # the callback adapter without `AccumulationScheduler`: Lightning's own loop (k = 1)
    estimate: bool = False  # `configure_optimizers` calls `lightning_accum.estimated_stepping_batches(trainer)`
    # the callback's `microbatch_size` (None, an int, or "auto"); with "auto", `oom` = [above, "forward" |
    # "backward"]: the model runs out of memory (injected) in that pass of a piece of more than `above` samples
    microbatch_size: Any = None
    oom: list[Any] | None = None
    fail_piece: int = 0  # a "training_step" failure fires at this piece (0-based) of its batch
    # the mixin: `zero_grad()` left in `training_step` (refused); a first fit stopped (`trainer.should_stop`) after
    # batch [epoch, batch], inside a window, then `trainer.fit` again on the same model (a new Trainer, no checkpoint)
    zero_grad: bool = False
    refit: list[int] | None = None
    # issue 42: the first layer frozen and outside the optimizer until batch [epoch, batch], where it is unfrozen
    # and added as a param group of its own (`BaseFinetuning`'s way); `training_step` taking the mask out of its
    # batch (`labels = batch.pop("labels")`), the count then falling back to every position where the mask is gone
    unfreeze: list[int] | None = None
    mutate: bool = False
    # issue 44: a BatchNorm layer in the net (`model.make_net`) and the adapter's `batchnorm=` ("micro-batch" |
    # "window"; None: no BatchNorm layer); its momentum, a float or None (the cumulative average)
    batchnorm: str | None = None
    bn_momentum: float | None = 0.1
    # issue 51: the Trainer's or Fabric's `precision` ("64-true", or "bf16-true": the parameters and their `.grad`
    # bf16) and the adapter's `grad_accum_dtype` (None, or "float32": each window's gradient of the bf16 parameters
    # summed and normalised in float32 and rounded to bf16 once); the reference's bf16 arithmetic: `bf16_reference.py`
    precision: str = "64-true"
    grad_accum_dtype: str | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Config:
        return cls(**json.loads(text))

    def units(self) -> set[str]:
        units = {self.schedule.get("unit", "")}
        if self.lr_schedule is not None:
            units.add(self.lr_schedule["unit"])
        return units

    def monitors(self) -> bool:
        """Whether something acts at each epoch's end on a logged metric, or the model steps a scheduler there
        (Lightning skips an epoch's end when it resumes from a checkpoint written at the epoch's last batch, so
        no such checkpoint is used then)."""
        scheduler = self.scheduler or {}
        by_model = self.schedulers_by != "package" and scheduler.get("interval", "epoch") == "epoch"
        plateau = scheduler.get("kind") == "plateau"
        return "early_stopping" in self.callbacks or plateau or (by_model and bool(scheduler))

    def refused(self) -> bool:
        """Whether the package must refuse the configuration (a scheduler stepped by the model and the mixin)."""
        return self.refusal() is not None

    def refusal(self) -> str | None:
        """What the package's refusal says (a scheduler stepped by the model and the mixin, a `zero_grad()` in
        `training_step`), where it must refuse the configuration."""
        if self.adapter == "mixin" and self.zero_grad:
            return "`zero_grad()` was called during training"
        if self.adapter == "mixin" and self.scheduler is not None and self.schedulers_by == "both":
            return "was stepped by the model"
        if self.grad_accum_dtype is not None and self.world > 1 and self.strategy == "fsdp2":
            return "`grad_accum_dtype='float32'` cannot work here. FSDP2"
        return None

    @property
    def bf16(self) -> bool:
        """Whether the parameters are bf16 (``precision="bf16-true"``)."""
        return self.precision == "bf16-true"

    def step_plateau(self) -> bool:
        """A `ReduceLROnPlateau` of `interval="step"`, on a metric the model logs in `on_train_batch_end`."""
        return self.scheduler is not None and self.scheduler == {"kind": "plateau", "interval": "step"}

    def batches_per_epoch(self) -> int:
        """Per process: rank r's j-th batch is the data's batch ``j * world + r``."""
        n = -(-self.n // self.batch_size) // self.world
        return n if self.limit_train_batches is None else min(n, self.limit_train_batches)

    def epoch_keyed(self) -> bool:
        """Whether the schedule or the LR schedule is keyed on epochs (`epoch=` is then required)."""
        return "epoch" in self.units()


def generate(rng: random.Random) -> Config:
    """A random combination of the options (every one reachable, each with a fair chance)."""
    c = Config(seed=rng.randrange(1000))
    c.adapter = rng.choice(["callback", "mixin"])  # (or "fabric": see `fabric_config`)
    c.batch_size = rng.choice([2, 3, 4])
    c.n = rng.randint(5, 30)
    c.epochs = rng.choice([1, 2, 2, 3])
    if rng.random() < 0.25:
        c.limit_train_batches = rng.randint(1, c.batches_per_epoch())
    batches = c.batches_per_epoch()
    if rng.random() < 0.2:
        c.max_steps = rng.randint(1, 2 * batches)
    c.normalize = rng.choice(["mean", "items"])
    if c.normalize == "items":
        c.reduction = rng.choice(["sum", "mean"])
        if rng.random() < 0.4:
            c.empty_batches = sorted(rng.sample(range(batches), rng.randint(1, min(3, batches))))
    c.schedule = _schedule(rng, batches)
    if c.lr_schedule is None and rng.random() < 0.25:
        unit = rng.choice(["step", "samples", "items", "epoch"])
        total = {"step": 12, "samples": 60, "items": 150, "epoch": 3}[unit]
        c.lr_schedule = {"warmup": total // 4, "total": total, "unit": unit, "final": rng.choice([0.0, 0.1])}
    c.count = c.normalize == "items" or "items" in c.units() or rng.random() < 0.3
    if c.adapter == "mixin":
        mean_items = c.normalize == "items" and c.reduction == "mean"  # `acc.backward(mean, items=n)`
        modes = ["backward", "items_int"] if mean_items else ["backward", "each", "heads", "microbatches", "cached"]
        c.mode = rng.choice(modes)
    c.optimizer = rng.choice(["sgd", "momentum", "adam"])
    if c.adapter == "mixin" and c.mode != "heads" and rng.random() < 0.3:
        c.optimizers, c.shared = 2, rng.random() < 0.5
    c.lr = 0.01 if c.optimizer == "adam" else 0.1
    if rng.random() < 0.3:  # (at the edges too: all but nothing clipped, or never)
        c.clip = [rng.choice([1e-9, 0.05, 0.5, 1e9]), rng.choice(["norm", "value"])]
    if rng.random() < 0.25:
        c.lr_scaling = rng.choice(["linear", "sqrt"])
    r = rng.random()
    if r < 0.15:
        c.scheduler = {"kind": "step", "interval": "step", "step_size": rng.randint(1, 3)}
    elif r < 0.3:
        c.scheduler = {"kind": "step", "interval": "epoch", "step_size": 1}
    elif r < 0.4:
        c.scheduler = {"kind": "plateau"}
    if rng.random() < 0.25 and not c.shared:  # (one residual per optimizer: a shared parameter would get two)
        mode = rng.choice(["sum", "ema"])
        c.decay = [rng.choice([0.0, 0.5, 0.9]), mode, mode == "ema" and rng.random() < 0.5]
    if rng.random() < 0.25:
        c.val_every = rng.randint(1, max(1, batches))
    for name in ("model_checkpoint", "lr_monitor", "early_stopping", "ema", "progress_bar"):
        if rng.random() < 0.15:
            c.callbacks.append(name)
    if c.monitors() and rng.random() < 0.5:
        c.monitor = "accum/loss"
        if c.clip is not None and c.clip[0] < 1e-6:  # (a model held still: its float64 losses tie, and a monitor's
            c.clip[0] = 0.05  # decisions would turn on their last bits, which two ways of summing need not share)
    if c.optimizers == 1 and rng.random() < 0.15:
        c.swa = [c.lr / 2, rng.randint(1, c.epochs)]
    total = batches * c.epochs
    # (Lightning's SWA resumed inside an epoch does not step its SWALR at that epoch's end, package or not)
    for _ in range(0 if c.swa else rng.choice([0, 0, 1, 2])):
        kind = "save" if rng.random() < 0.4 else rng.choice(FAILURES)
        at = rng.randrange(total)
        if c.monitors() and at % batches == batches - 1:
            continue  # (see `Config.monitors`)
        c.interruptions.append([kind, at // batches, at % batches])
    c.interruptions.sort(key=lambda i: (i[1], i[2]))
    if c.mode == "cached":
        c.chunks = [rng.randint(1, 3), rng.randint(1, 5)]
        _cached_options(c, random.Random(c.seed * 1009 + 32))  # (its own generator: the others' draws stay)
    _contracts(rng, c, batches)
    _lightning_order(c, batches)
    if rng.random() < 0.15:  # the same options in a Fabric loop, where it has them
        c = fabric_config(c, rng)
    if c.adapter == "callback" and not c.plain:  # (`microbatch_size` is the package callback's)
        _callback_refit(c, batches)
        _microbatches(c)
        _none_losses(c, batches)
        _lightning_code(c, batches)
    if c.adapter == "mixin":
        _mean_by(c)
    _noise(c)
    _batchnorm(c)
    _budget(c)
    _bf16(c)
    _unfreeze(c)
    return c


def _unfreeze(c: Config) -> None:
    """The first layer frozen till a batch where it joins the first optimizer as a param group of its own
    (``unfreeze``, `_lightning_code`) where that leaves it out (issue 53): with a resume (failures and checkpoints,
    one written after the join holding the group), ``GradientDecay`` (a residual from the window after the join
    on), SWA (joining before SWA's first epoch: Lightning's `StochasticWeightAveraging` makes its `SWALR`'s per-group
    lists as that epoch starts, and a group added after it has none, package or not), two optimizers sharing a window
    (the first layer joins the first, which holds the BatchNorm layer's parameters or the last layer's bias till
    then: an optimizer of nothing is refused by torch) and the mixin (every mode; `backward_heads` where the trunk has
    something to train before the join, its BatchNorm layer: a trunk of frozen layers gives features without a graph,
    which the package refuses as it cannot be told from a `.detach()`, naming the fix); drawn from a generator of the
    configuration's own, after the others (their draws stay as they were). Not: in a Fabric loop (the helper's param
    groups have unit tests), on several ranks, under bf16 (`_bf16`'s reference), with a window per optimizer (the
    reference's `_each` forms no join), `NoiseScale` or AdaScale (`_noise`), a plateau (its per-group list) or
    `LearningRateMonitor` (its names, made at the start), nor a refit (a new fit's optimizer is made again)."""
    rng = random.Random(f"unfreeze/{c.seed}/{c.n}/{c.batch_size}/{c.epochs}/{len(c.interruptions)}")
    if c.unfreeze is not None or rng.random() >= 0.2:
        return
    if c.adapter not in ("callback", "mixin") or c.plain or c.world > 1 or c.bf16 or c.refit is not None:
        return
    plateau = (c.scheduler or {}).get("kind") == "plateau"
    if c.schedule["family"] == "noise" or c.lr_scaling == "adascale" or plateau or c.windows == "each":
        return
    if c.optimizers == 2 and not c.shared and c.batchnorm is None:
        return
    if c.mode == "heads" and c.batchnorm is None:  # (a trunk with nothing to train: `backward_heads` refuses it)
        return
    epochs = range(c.epochs) if c.swa is None else range(int(c.swa[1]) - 1)  # (before SWA's first epoch)
    batches = [b for b in range(c.batches_per_epoch()) if c.adapter != "mixin" or b not in c.skip]
    joins = [[epoch, b] for epoch in epochs for b in batches]
    if joins:
        c.unfreeze = rng.choice(joins)
        c.callbacks = [name for name in c.callbacks if name != "lr_monitor"]


def _budget(c: Config) -> None:
    """``Budget`` (issue 46): windows closed by their count over ranks (samples, or items with `count`), its `n` an
    int or a ramp of its own, with or without `max_k`; drawn from a generator of the configuration's own (the other
    configurations' draws stay as they were). Not with `NoiseScale` or AdaScale (refused beside a budget), in
    Lightning's own loop (`plain`), nor with a window per optimizer. The callback's batches whose `training_step`
    returns `None` count (a budget counts a loader batch as it starts, and `max_k` loader batches, as k does)."""
    rng = random.Random(f"budget/{c.seed}/{c.n}/{c.batch_size}/{c.epochs}/{len(c.interruptions)}")
    if rng.random() >= 0.2:
        return
    if c.plain or c.windows == "each" or c.schedule["family"] == "noise" or c.lr_scaling == "adascale":
        return
    unit = rng.choice(["items", "samples"])
    per = c.batch_size * c.world * (3 if unit == "items" else 1)  # (about a micro-batch's count over ranks)
    n: Any = rng.randint(1, 4 * per)
    if rng.random() < 0.3:  # a budget that ramps
        inner = rng.choice(["samples", "items", "step"])
        over = {"samples": rng.randint(5, 60), "items": rng.randint(10, 150), "step": rng.randint(1, 8)}[inner]
        n = {"family": "ramp", "start": rng.randint(1, 2 * per), "end": rng.randint(1, 4 * per), "over": over,
             "unit": inner}  # fmt: skip
    c.schedule = {"family": "budget", "n": n, "unit": unit, "max_k": rng.choice([None, None, rng.randint(1, 4)])}
    # issue 52: the mixin and the Fabric loop read the counts ahead (a generator of its own: the draws above stay)
    ahead = random.Random(f"read_ahead/{c.seed}/{c.n}/{c.batch_size}/{c.epochs}")
    c.read_ahead = c.adapter in ("mixin", "fabric") and ahead.random() < 0.5
    c.count = c.count or "items" in c.units() or (isinstance(n, dict) and n["unit"] == "items")
    inner_items = isinstance(n, dict) and n["unit"] == "items"
    c.estimate = c.estimate and unit == "samples" and not inner_items and c.world == 1
    # issue 53: under "mean", batches of no item, so that a window's count can be 0 (closed by `max_k` or the epoch's
    # end): it is stepped, with the guide's LR factor of 0 under `lr_scaling`
    batches = c.batches_per_epoch()
    if unit == "items" and c.normalize == "mean" and not c.empty_batches and rng.random() < 0.5:
        c.empty_batches = sorted(rng.sample(range(batches), rng.randint(1, min(3, batches))))
        if c.lr_scaling is None and rng.random() < 0.5:
            c.lr_scaling = rng.choice(["linear", "sqrt"])


def _bf16(c: Config) -> None:
    """``precision="bf16-true"`` (issue 51) in about 15% of the configurations, half of them with
    ``grad_accum_dtype="float32"``, drawn from a generator of the configuration's own (the other configurations' draws
    stay as they were), in every adapter and with every other option where the bf16 reference follows the package bit
    for bit (``bf16_reference.py``). Not drawn beside ``NoiseScale`` or AdaScale (their statistics are continuous
    functions of the gradients in the package's own float arithmetic, which no bit-exact reference can follow). Left out
    under bf16: ``GradientDecay`` (with the option its residual is carried in float32 from step to step, in the
    package's own arithmetic: ``tests/test_wide_decay.py`` holds it to float64), BatchNorm's ``"window"`` statistics
    (pooled in the package's own arithmetic: ``"micro-batch"`` instead, torch's own update, with its restrictions,
    ``_batchnorm``; and with them issue 53's forwards without a backward, drawn only beside them), a monitor on
    ``accum/loss`` (a report of the losses as they reached backward: the probe instead). Lightning's own loop
    (``plain``) has no ``grad_accum_dtype`` to take."""
    rng = random.Random(f"bf16/{c.seed}/{c.n}/{c.batch_size}/{c.epochs}/{len(c.interruptions)}")
    if rng.random() >= 0.24:
        return
    if c.schedule["family"] == "noise" or c.lr_scaling == "adascale":
        return
    c.precision = "bf16-true"
    if not c.plain and rng.random() < 0.5:
        c.grad_accum_dtype = "float32"
    c.decay = None
    c.monitor = "probe"
    if c.batchnorm == "window":
        c.batchnorm = "micro-batch"
        c.skip_forward = False  # (drawn only beside "window": under "micro-batch" its forward is torch's own update)
        c.interruptions = [i for i in c.interruptions if i[0] in FORWARD_ONCE]
        c.fail_piece = 0
        c.refit = None


def _noise(c: Config) -> None:
    """``NoiseScale`` (``{"family": "noise", "min_k", "max_k", ...}``) and ``lr_scaling="adascale"`` (issue 42), with
    ``lr_schedule`` or the schedule keyed on AdaScale's ``"scaled_steps"``, drawn from a generator of the
    configuration's own (the other configurations' draws stay as they were). Not where the package refuses them:
    `estimated_stepping_batches` under `NoiseScale` or a schedule on `"scaled_steps"`, AdaScale beside a schedule
    of k = 1 throughout (their refusals have unit tests); nor in Lightning's own loop (`plain`: no package
    callback) or with a window per optimizer (``windows="each"``), nor with a param group added during the fit
    (``unfreeze``: a window whose parameters change inside it has no one measurement; the package measures each
    prefix over the parameters of its moment, "Adaptive k" in the docs)."""
    rng = random.Random(f"noise/{c.seed}/{c.n}/{c.batch_size}/{c.epochs}/{len(c.interruptions)}")
    if c.plain or c.windows == "each" or c.unfreeze is not None:
        return
    if rng.random() < 0.2:
        low = rng.choice([2, 2, 3])
        spec: dict[str, Any] = {"family": "noise", "min_k": low, "max_k": rng.randint(low, low + 4)}
        if rng.random() < 0.3:
            spec["start"] = rng.randint(low, spec["max_k"])
        spec["every"] = rng.choice([1, 1, 2, 3])
        spec["warmup"] = rng.choice([1, 1, 2, 3])
        spec["hysteresis"] = rng.choice([0.0, 0.05, 0.05, 0.4])
        spec["beta"] = rng.choice([0.0, 0.5, 0.9, 0.995])
        spec["max_ratio"] = rng.choice([1.2, 2.0, 2.0, 4.0])
        c.schedule, c.estimate = spec, False
    if rng.random() < 0.25 and not _always_one(c.schedule):
        c.lr_scaling = "adascale"
        if rng.random() < 0.4:
            final = c.lr_schedule["final"] if c.lr_schedule is not None else rng.choice([0.0, 0.1])
            c.lr_schedule = {"warmup": 2, "total": 8, "unit": "scaled_steps", "final": final}
        if c.schedule.get("unit") == "step" and rng.random() < 0.4:
            c.schedule = {**c.schedule, "unit": "scaled_steps"}
            c.estimate = False


def _always_one(spec: dict[str, Any]) -> bool:
    """Whether a schedule gives k = 1 throughout, as the package tells (AdaScale is refused beside it)."""
    family = spec["family"]
    if family == "constant":
        return bool(spec["k"] == 1)
    if family == "piecewise":
        return max(k for _, k in spec["milestones"]) == 1
    if family == "ramp":
        return bool(max(spec["start"], spec["end"]) == 1)
    return False


def _batchnorm(c: Config) -> None:
    """A BatchNorm layer in the net and ``batchnorm="micro-batch" | "window"`` (issue 44), drawn from a generator of
    the configuration's own (the other configurations' draws stay as they were), where the reference can follow
    every forward: not with the mixin's `backward_each` (each closure runs the micro-batch again) or `backward_cached`
    (its chunks are normalised apart), a window per optimizer (a forward per optimizer), SWA (its BatchNorm epoch),
    ``microbatch_size="auto"`` (refused under "window"; an out-of-memory piece's forward counted under
    "micro-batch"), nor on several ranks (`ranks_config`). Lightning's own loop (``plain``) has "micro-batch" only.
    Under "micro-batch" a forward's statistics are in the buffers at once, so there is no failure between a batch's
    forward and its end (`on_before_backward`, `on_after_backward`, `on_before_optimizer_step`: resumed, the batch
    runs again and counts twice, package or not, as in Lightning alone) nor inside validation, and no refit (the
    stopped window's forwards count); under "window" every failure and resume is drawn."""
    rng = random.Random(f"batchnorm/{c.seed}/{c.n}/{c.batch_size}/{c.epochs}/{len(c.interruptions)}")
    if rng.random() >= 0.3:
        return
    if c.mode in ("each", "cached") or c.windows == "each" or c.swa is not None or c.microbatch_size == "auto":
        return
    if c.world > 1:
        return
    c.batchnorm = "micro-batch" if c.plain else rng.choice(["micro-batch", "window"])
    c.bn_momentum = rng.choice([0.1, 0.5, None])
    if c.batchnorm == "micro-batch":
        c.interruptions = [i for i in c.interruptions if i[0] in FORWARD_ONCE]
        c.fail_piece = 0
        c.refit = None
    elif c.skip and rng.random() < 0.7:  # (issue 53: under "micro-batch" such a forward is BatchNorm's own update)
        c.skip_forward = True


def _mean_by(c: Config) -> None:
    """The mixin's ``reduction="mean"`` (issue 35) for a token mean, in any mode, drawn from a generator of the
    configuration's own (the other configurations' draws stay as they were)."""
    rng = random.Random(f"mean_by/{c.seed}/{c.n}/{c.batch_size}/{c.epochs}/{len(c.interruptions)}")
    if c.normalize != "items" or c.reduction != "mean" or rng.random() >= 0.6:
        return
    c.mean_by = "reduction"
    if c.windows == "each":  # (a window per optimizer: one pass of each)
        c.mode = "backward"
        return
    modes = ["backward", "each", "microbatches", "cached"] + (["heads"] if c.optimizers == 1 else [])
    c.mode = rng.choice(modes)
    if c.mode == "cached":
        c.chunks = [rng.randint(1, 3), rng.randint(1, 5)]
        _cached_options(c, random.Random(c.seed * 1009 + 32))


def _contracts(rng: random.Random, c: Config, batches: int) -> None:
    """Lightning's contracts around the package (issue 31): who steps the schedulers, where the probe is
    logged, a window per optimizer, skipped batches, Lightning's loop without accumulation, the step count."""
    c.probe_in = rng.choice(["callback", "module"])
    c.estimate = rng.random() < 0.3 and c.schedule.get("unit") != "items"
    if c.adapter == "callback" and rng.random() < 0.1:  # `GradientDecay` (or nothing) in Lightning's own loop
        c.plain, c.schedule, c.normalize, c.reduction = True, {"family": "constant", "k": 1}, "mean", "sum"
        c.count = False
        c.empty_batches, c.lr_scaling, c.lr_schedule, c.monitor = [], None, None, "probe"  # (no `accum/*` to watch)
        c.callbacks = [name for name in c.callbacks if name != "ema"]  # (no window ends)
        c.interruptions = c.interruptions[:1]  # (Lightning alone counts a batch retried after two failures twice)
        if c.max_steps != -1:  # (and resumed from SIGTERM at an epoch's last batch, it ends the next epoch after
            # one batch: `_seam.resume_after_finished_epoch` mends that for `AccumulationScheduler` only)
            c.interruptions = [i for i in c.interruptions if not (i[0] == "sigterm" and i[2] == batches - 1)]
        if c.scheduler == {"kind": "plateau"}:  # (nor does it step a ReduceLROnPlateau at the end of an epoch it
            # resumed inside: the loop is still "restarting"; `_seam.step_plateau_after_resume` mends that for
            # `AccumulationScheduler` only; found with seed 57)
            c.interruptions = []
        c.estimate = rng.random() < 0.7
        if c.decay is None and rng.random() < 0.7:
            c.decay = [rng.choice([0.0, 0.5, 0.9]), "sum", False]
    if c.adapter != "mixin":
        return
    if c.scheduler is not None and c.swa is None:
        c.schedulers_by = rng.choice(["package", "package", "user", "user", "both"])
    if rng.random() < 0.15:  # two optimizers, each with a window of its own (a GAN's habit)
        c.windows, c.optimizers, c.shared, c.decay, c.swa, c.skip = "each", 2, False, None, None, []
        c.mode = c.mode if c.mode in ("backward", "items_int") else "backward"
    elif c.optimizers == 1 and c.swa is None and batches > 1 and rng.random() < 0.25:
        c.skip = sorted(rng.sample(range(batches), rng.randint(1, max(1, batches // 2))))
    if c.monitors():  # (see `Config.monitors`: a scheduler the model steps at the epoch's end is one)
        c.interruptions = [i for i in c.interruptions if i[2] != batches - 1]


def _lightning_order(c: Config, batches: int) -> None:
    """Where the mixin meets Lightning's order of hooks (the adversarial pass after issue 31), drawn from a
    generator of the configuration's own (the other draws stay as they were): a step-interval plateau on a metric
    logged after the batch (either adapter), a `zero_grad()` left in the mixin's `training_step`, a refit after a
    fit stopped inside a window."""
    rng = random.Random(f"order/{c.seed}/{c.n}/{c.batch_size}/{c.epochs}/{len(c.interruptions)}")
    if c.swa is None and rng.random() < 0.12:
        c.scheduler, c.schedulers_by = {"kind": "plateau", "interval": "step"}, "package"
        # (Lightning steps it after the batch's end hooks: a checkpoint written there, or a failure after them,
        # misses that batch's step, package or not; so only failures before the batch is processed)
        c.interruptions = [i for i in c.interruptions if i[0] in ("on_train_batch_start", "training_step")]
    if c.adapter != "mixin":
        return
    r = rng.random()
    if r < 0.04:
        c.zero_grad = True
    elif r < 0.14 and batches > 1 and c.swa is None:
        c.refit, c.interruptions = [0, rng.randrange(batches - 1)], []


def _callback_refit(c: Config, batches: int) -> None:
    """A fit stopped inside a window, then `trainer.fit` again by a new Trainer with the same package callbacks
    (their progress, first k and decay go on, as the mixin's model's do), drawn from a generator of the
    configuration's own."""
    rng = random.Random(f"refit/{c.seed}/{c.n}/{c.batch_size}/{c.epochs}/{len(c.interruptions)}")
    if c.swa is None and batches > 1 and rng.random() < 0.1:
        c.refit, c.interruptions = [0, rng.randrange(batches - 1)], []


def _microbatches(c: Config) -> None:
    """The callback's ``microbatch_size`` (and injected out-of-memory errors for ``"auto"``), drawn from a
    generator of the configuration's own, so that the other configurations' draws stay as they were."""
    rng = random.Random(f"microbatch/{c.seed}/{c.n}/{c.batch_size}/{c.epochs}/{len(c.interruptions)}")
    if rng.random() >= 0.35:
        return
    c.microbatch_size = rng.choice([1, 2, 3, "auto", "auto"])
    if c.microbatch_size == "auto":
        c.oom = [rng.randint(1, c.batch_size), rng.choice(["forward", "backward"])]
    if any(kind == "training_step" for kind, _, _ in c.interruptions):
        c.fail_piece = rng.choice([0, 1])


def _lightning_code(c: Config, batches: int) -> None:
    """Ordinary Lightning code around ``microbatch_size`` (issue 42), drawn from a generator of the configuration's
    own: a param group added during the fit, and a ``training_step`` that changes its batch. Mostly with pieces, as
    that is where both were silently wrong; not with what cannot take a new param group (a second optimizer, SWA's
    and a plateau's per-group lists made at their start, `LearningRateMonitor`'s names, a decay residual the
    reference keeps per parameter) nor with a resume (the restored optimizer must be given the group first, as
    `BaseFinetuning` does)."""
    rng = random.Random(f"lightning_code/{c.seed}/{c.n}/{c.batch_size}/{c.epochs}/{len(c.interruptions)}")
    chance = 0.5 if c.microbatch_size is not None else 0.15
    plateau = (c.scheduler or {}).get("kind") == "plateau"
    takes_group = c.optimizers == 1 and c.swa is None and not plateau and c.decay is None
    if takes_group and rng.random() < chance:
        c.unfreeze = [rng.randrange(c.epochs), rng.randrange(batches)]
        c.interruptions, c.refit = [], None
        c.callbacks = [name for name in c.callbacks if name != "lr_monitor"]
    if rng.random() < chance:
        c.mutate = True


def _none_losses(c: Config, batches: int) -> None:
    """Batches whose `training_step` returns `None` under the callback (Lightning runs no backward pass; the
    window keeps its k loader batches, and what went in is normalised by itself), drawn from a generator of the
    configuration's own. Not in Lightning's own loop (`plain`), whose step after a `None` moves Adam anyway, nor
    with SWA (its BatchNorm epoch runs no backward pass either)."""
    rng = random.Random(f"none/{c.seed}/{c.n}/{c.batch_size}/{c.epochs}/{len(c.interruptions)}")
    if c.swa is None and rng.random() < 0.2:
        c.skip = sorted(rng.sample(range(batches), rng.randint(1, max(1, batches // 2))))


def fabric_config(c: Config, rng: random.Random) -> Config:
    """``c`` without what a Fabric loop does not have (Lightning's callbacks, schedulers, validation,
    SWA, decay, failures at Lightning hooks, the mixin's modes): the ``"fabric"`` adapter's config, with
    what only it has: two backward passes per micro-batch, checkpoints saved again right after their
    load, and loops that give no `epoch=` (refused first where a schedule is keyed on epochs)."""
    c.adapter, c.mode, c.optimizers, c.shared, c.chunks = "fabric", "backward", 1, False, [2, 2]
    c.mean_by = "items"  # (the mixin's)
    c.scheduler = c.decay = c.val_every = c.swa = None
    c.callbacks, c.monitor = [], "probe"
    c.interruptions = [i for i in c.interruptions if i[0] == "save"]
    c.schedulers_by, c.probe_in, c.windows, c.skip = "package", "callback", "shared", []
    c.plain = c.estimate = c.zero_grad = False
    c.refit = None
    c.microbatch_size, c.oom, c.fail_piece = None, None, 0
    c.unfreeze, c.mutate = None, False  # (the callback's draws: the helper's param groups have unit tests)
    c.batchnorm = None  # (drawn after: `generate`)
    c.passes = rng.choice([1, 1, 2])
    c.resave = bool(c.interruptions) and rng.random() < 0.5
    # (a `Lambda` reading the epoch cannot be seen to: without `epoch=` its epoch would stay 0)
    c.epoch_arg = c.schedule.get("fn") == "epoch_up" or rng.random() < 0.7
    c.last_arg = rng.random() < 0.5
    return c


def ranks_config(rng: random.Random) -> Config:
    """A Fabric loop on 2 processes (``ranks.py``), DDP or FSDP2: rank r takes every other batch."""
    c = fabric_config(generate(rng), rng)
    c.world, c.strategy = 2, rng.choice(["ddp", "fsdp2"])
    c.batchnorm = None  # (not on ranks: see `_batchnorm`)
    if c.schedule["family"] == "noise" or c.lr_scaling == "adascale":  # (refused under FSDP2: its unit tests)
        c.strategy = "ddp"
    c.last_arg = c.last_arg or c.strategy == "fsdp2"  # (FSDP2 needs to know a window's last micro-batch)
    if c.strategy == "fsdp2" and c.bf16 and c.grad_accum_dtype is None:  # (FSDP2 reduce-scatters bf16 gradients in its
        c.precision = "64-true"  # own arithmetic; with the option, its refusal is what is checked: `Config.refusal`)
    c.limit_train_batches = None
    c.n = rng.randint(3, 8) * 2 * c.batch_size - rng.randrange(c.batch_size)  # an even number of batches
    c.empty_batches = [b for b in c.empty_batches if b < -(-c.n // c.batch_size)]
    if c.strategy == "fsdp2" and c.reduction == "mean":  # (FSDP2 reduces the gradient a masked mean over no items
        c.empty_batches = []  # makes NaN; only strategies whose parameters are the graph's leaves can mask it)
    c.max_steps = -1 if c.max_steps == -1 else rng.randint(1, 2 * c.batches_per_epoch())
    total = c.batches_per_epoch() * c.epochs
    c.interruptions = [["save", at // c.batches_per_epoch(), at % c.batches_per_epoch()] for at in
                       sorted(rng.sample(range(total), min(total, len(c.interruptions))))]  # fmt: skip
    return c


def _schedule(rng: random.Random, batches: int) -> dict[str, Any]:
    family = rng.choice(["constant", "piecewise", "ramp", "lambda"])
    if family == "constant":
        return {"family": "constant", "k": rng.randint(1, 5)}
    if family == "piecewise":
        unit = rng.choice(["epoch", "step", "samples", "items"])
        scale = {"epoch": 1, "step": 3, "samples": 12, "items": 30}[unit]
        milestones = sorted(rng.sample(range(0, 4 * scale), rng.randint(1, 3)))
        return {"family": "piecewise", "unit": unit, "milestones": [[m, rng.randint(1, 4)] for m in milestones]}
    if family == "ramp":
        unit = rng.choice(["samples", "items", "step"])
        over = {"samples": rng.randint(5, 60), "items": rng.randint(10, 150), "step": rng.randint(1, 8)}[unit]
        start, end = rng.randint(1, 4), rng.randint(1, 5)
        return {"family": "ramp", "start": start, "end": end, "over": over, "unit": unit}
    return {"family": "lambda", "fn": rng.choice(LAMBDAS)}


def _cached_options(c: Config, rng: random.Random) -> None:
    """The cached mode's loss blocks, token budgets and guide tower (issue 32)."""
    if rng.random() < 0.5:
        c.loss_chunk = rng.randint(1, 3)
    if rng.random() < 0.35:
        c.chunk_tokens = [rng.choice([None, 1, 2, 3]), rng.choice([None, 1, 2])]
        pairs = zip(c.chunks, c.chunk_tokens, strict=True)
        c.chunks = [None if t is not None and rng.random() < 0.5 else k for k, t in pairs]  # (no row cap)
    if rng.random() < 0.3:
        c.guide = rng.choice(["frozen", "no_grad"])
