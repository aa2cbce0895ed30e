"""The mixin's window bookkeeping: which of the module's optimizers step together (a window group,
keyed by their sorted indices in ``self.optimizers()``), their parameters, and one
``WindowEngine`` per group, with the groups' checkpoint state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from lightning_accum import _seam
from lightning_accum._core import gradients, sync
from lightning_accum._core.batchnorm import WindowBatchNorm
from lightning_accum._core.engine import WindowEngine, samples_needed_by
from lightning_accum._core.options import AccumulationConfig
from lightning_accum._core.wide import WideSums
from lightning_accum.schedules import as_schedule

GroupKey = tuple[int, ...]


class MixinWindows:
    """The window groups of one module, one engine each.

    Example:

        >>> windows = MixinWindows(module=None)
        >>> windows.engine((0,)).schedule
        Constant(1)
    """

    def __init__(self, module: Any) -> None:
        self.module = module
        self.config = AccumulationConfig(schedule=as_schedule(1))
        self.engines: dict[GroupKey, WindowEngine] = {}
        self._plan = sync.SyncPlan()
        self._track = False  # whether the windows' losses are tracked (while logging)
        self._optimizers: list[Any] | None = None  # the fit's (Lightning asks its strategy on every call)
        #: `batchnorm="window"`: the module's BatchNorm statistics, advanced with the (one) group's windows
        self.batchnorm: WindowBatchNorm | None = None
        #: `grad_accum_dtype`: the narrow parameters' window sums, of every group (each engine steps its own)
        self.wide: WideSums | None = None
        self._widening = False  # (a fit is on: a group's engine made now takes its sums at once)
        self._sizes: tuple[tuple[int, ...], ...] = ()  # the optimizers' param groups' sizes the sums were taken for

    def configure(self, config: AccumulationConfig) -> None:
        self.config = config
        if config.batchnorm != "window":
            self.batchnorm = None
        elif self.batchnorm is None:
            self.batchnorm = WindowBatchNorm()
        for engine in self.engines.values():
            engine.configure(
                config.schedule, config.normalize, config.lr_scaling, config.lr_schedule, config.reduction,
                config.grad_accum_dtype,
            )  # fmt: skip
            engine.pool_batchnorm(self.batchnorm)

    def start_fit(self, plan: sync.SyncPlan, track: bool) -> None:
        self._plan, self._track = plan, track
        self._optimizers = None
        for engine in self.engines.values():
            engine.start_fit(plan, track)

    def widen(self) -> bool:
        """At a fit's start (its optimizers known): every group's narrow parameters have their window sums kept in
        ``grad_accum_dtype``, one ``WideSums`` for all (sums held from before kept); whether any parameter is narrow."""
        dtype = self.config.grad_accum_dtype
        if dtype is None:
            self.wide = None
            return False
        if self.wide is None or self.wide.dtype != dtype:
            self.wide = WideSums(dtype)
        self.wide.attach(self.params())
        self._widening = True
        self._sizes = self._group_sizes()
        for key, engine in self.engines.items():
            engine.widen(self.params(key), self.wide)
        return self.wide.active

    def _group_sizes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(gradients.group_sizes(o.optimizer) for o in self.optimizers())

    def widen_joined(self) -> None:
        """As a block opens: a param group added to an optimizer during the fit (``BaseFinetuning``), inside a window
        too, has its narrow parameters' sums kept in ``grad_accum_dtype`` from this micro-batch on (those held kept)."""
        if self._widening and self.wide is not None and self._group_sizes() != self._sizes:
            self.widen()

    def rewiden(self) -> None:
        """As a window opens: the narrow parameters taken again if they changed since ``widen`` (a param group added,
        a parameter unfrozen), where no group's window holds a sum, or where those joining are outside every window
        that does (another optimizer's, its windows staggered with this one's) and the sums are on already."""
        if self.wide is None or not self.wide.stale(self.params()):
            return
        if not self.window_open() or self._joining_outside_open_windows(self.wide):
            self.widen()

    def _joining_outside_open_windows(self, wide: WideSums) -> bool:
        joining = wide.joining(self.params())
        if joining is None or not wide.active:  # (a parameter leaving, or the sums' path switched on mid-window)
            return False
        held = {id(p) for key, e in self.engines.items() if e.window is not None and e.window.microbatches
                for p in self.params(key)}  # fmt: skip
        return not any(id(p) in held for p in joining)

    def unwiden(self) -> None:
        """At a fit's end: the sums take no more gradients (those held are kept, for a checkpoint)."""
        self._widening = False
        if self.wide is not None:
            self.wide.detach()

    def wide_sums(self) -> WideSums | None:
        """Where the narrow parameters' window sums are (``None``: ``.grad`` holds every window's gradient)."""
        return self.wide if self.wide is not None and self.wide.active else None

    def engine(self, key: GroupKey) -> WindowEngine:
        """The group's engine (made now if it has none)."""
        engine = self.engines.get(key)
        if engine is None:
            if self.batchnorm is not None and self.engines:
                self.refuse_window_of_some(key)
            c = self.config
            engine = self.engines[key] = WindowEngine(
                c.schedule, c.normalize, c.lr_scaling, c.lr_schedule, c.reduction, c.grad_accum_dtype
            )
            engine.start_fit(self._plan, self._track)
            engine.pool_batchnorm(self.batchnorm)
            if self._widening:
                engine.widen(self.params(key), self.wide)
        return engine

    def refuse_window_of_some(self, key: GroupKey) -> None:
        """``batchnorm="window"`` advances BatchNorm's statistics with one window, that of every optimizer: a block
        of a window of some optimizers is refused as it opens, before any of it runs (so a model that opens windows
        of its optimizers one by one has its first refused before anything is trained)."""
        if self.batchnorm is None or (key in self.engines and len(self.engines) == 1):
            return
        other = next((k for k in self.engines if k != key), None)
        if other is not None or key != tuple(range(len(self.optimizers()))):
            given = f"optimizers {list(key)}" + ("" if other is None else f" beside the window of {list(other)}")
            raise ValueError(
                f"`batchnorm='window'` advances BatchNorm's statistics with one window of every optimizer, but this "
                f"model opens a window of {given} (`self.accumulate(batch, optimizer=...)`): keep one window "
                "(`self.accumulate(batch)` with no `optimizer=`), or use `configure_accumulation(batchnorm="
                "'micro-batch')`."
            )

    def samples_needed_by(self) -> str | None:
        """What needs each micro-batch's sample count (the same for every group)."""
        c = self.config
        return samples_needed_by(c.schedule, c.normalize, c.lr_scaling)

    # ------------------------------------------------------------------ optimizer groups
    def optimizers(self) -> list[Any]:
        """The module's (Lightning-wrapped) optimizers, as a list (read once a fit)."""
        if self._optimizers is None:
            found = self.module.optimizers()
            self._optimizers = list(found) if isinstance(found, list | tuple) else [found]
        return self._optimizers

    def key(self, optimizer: Any) -> GroupKey:
        """The group of ``optimizer``: ``None`` (all), an optimizer, its index, or a list of them."""
        known = self.optimizers() if _seam.attached(self.module) else []
        if optimizer is None:
            return tuple(range(len(known)))
        chosen = []
        for o in optimizer if isinstance(optimizer, list | tuple) else [optimizer]:
            if isinstance(o, int) and 0 <= o < len(known):
                chosen.append(o)
                continue
            raw = getattr(o, "optimizer", o)
            matches = [i for i, lo in enumerate(known) if lo is o or lo.optimizer is raw]
            if not matches:
                raise ValueError(f"`optimizer` must be one of `self.optimizers()` or its index; got {o!r}.")
            chosen.append(matches[0])
        return tuple(sorted(set(chosen)))

    def log_prefix(self, key: GroupKey) -> str:
        """Where the group's windows are reported: ``accum/`` for a window of all the fit's optimizers (the
        default, and any window of a fit with one optimizer), ``accum/opt<i>/`` (``accum/opt0_2/`` for
        several) for a window of some of them. Fixed by the group, whatever other groups exist."""
        if len(key) == len(self.optimizers()):
            return "accum/"
        return f"accum/opt{'_'.join(map(str, key))}/"

    def params(self, key: GroupKey | None = None) -> list[Tensor]:
        """The parameters of the group's optimizers (all optimizers for ``None``), in order, each once (two
        optimizers of one window may share a parameter: its gradient counts once in the window's norms)."""
        known = self.optimizers()
        chosen = range(len(known)) if key is None else key
        every = [p for i in chosen for p in gradients.optimizer_params(known[i].optimizer)]
        return list({id(p): p for p in every}.values())

    def check_disjoint(self, new: GroupKey) -> None:
        """Refuse a window group whose parameters another group's window also accumulates into: each
        window's step would take the other's gradient too."""
        if new in self.engines:
            return
        mine = {id(p) for p in self.params(new)}
        names = {id(p): name for name, p in self.module.named_parameters()}
        for other in self.engines:
            shared = [names.get(id(p), "?") for p in self.params(other) if id(p) in mine]
            if shared:
                listed = ", ".join(shared[:5]) + (", ..." if len(shared) > 5 else "")
                raise ValueError(
                    f"The windows of optimizers {list(new)} and {list(other)} would share parameters ({listed}), so "
                    "each window's step would take the other window's gradient too. Accumulate them in one window "
                    "(`self.accumulate(batch, optimizer=[...])` naming all of them, or no `optimizer=`), or give each "
                    "optimizer its own parameters."
                )

    # ------------------------------------------------------------------ windows
    def window_open(self) -> bool:
        """Whether some window holds gradient that is not stepped yet."""
        return any(e.window is not None and e.window.microbatches for e in self.engines.values())

    def open_engines(self) -> list[WindowEngine]:
        return [self.engines[key] for key in sorted(self.engines) if self.engines[key].window is not None]

    def batch_done(self) -> None:
        for engine in self.engines.values():
            engine.batch_done()

    # ------------------------------------------------------------------ checkpoints
    def local_numbers(self) -> list[float]:
        """This rank's own part of every open window (``WindowEngine.local_numbers``)."""
        return [v for engine in self.open_engines() for v in engine.local_numbers()]

    def load_local_numbers(self, numbers: Sequence[float]) -> None:
        start = 0
        for engine in self.open_engines():
            end = start + engine.number_count()
            engine.load_local_numbers(numbers[start:end])
            start = end

    def state_dict(self) -> dict[str, Any]:
        return {",".join(map(str, key)): engine.state_dict() for key, engine in self.engines.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        c = self.config  # (every group checked first, by an engine of the configuration: a refusal changes nothing)
        checks = WindowEngine(c.schedule, c.normalize, c.lr_scaling, c.lr_schedule, c.reduction, c.grad_accum_dtype)
        for group in state.values():
            checks.check_state(group)
        self.engines = {}
        if self.wide is not None:  # (the windows are the state's: sums a failed fit left are no part of them)
            self.wide.clear()
        for name, group in state.items():
            self.engine(tuple(int(i) for i in name.split(",") if i)).load_state_dict(group)
