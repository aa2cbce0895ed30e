"""The residual gradient of ``GradientDecay``: a decaying memory of earlier windows' gradients.

Plain torch, no Lightning: the callback (``lightning_accum.callbacks.GradientDecay``) and the
mixin's ``reset=`` drive it from their hooks, as ``torch.optim.swa_utils.AveragedModel`` sits
beneath Lightning's weight averaging.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_accum._core import gradients
from lightning_accum._core.wide import WideSums

Factor = float | Callable[[int], float]
"""``GradientDecay``'s factor: a number in [0, 1), or ``factor(step) -> float`` for a factor that changes
with the optimizer step."""


class ResidualDecay:
    """The maths of ``GradientDecay`` (see there): the residual beside the window's gradient,
    combined with it before each step, kept after it.

    Example:

        >>> decay = ResidualDecay(0.5)
        >>> decay.factor_at(0), decay.mode
        (0.5, 'sum')
    """

    def __init__(
        self,
        factor: Factor,
        *,
        mode: Literal["sum", "ema"] = "sum",
        bias_correction: bool = False,
        save_residual: bool = True,
    ) -> None:
        if callable(factor):
            if bias_correction:
                raise ValueError("`bias_correction` needs a constant `factor`; give a float in [0, 1].")
        else:
            _check_factor(factor)
        if mode not in ("sum", "ema"):
            raise ValueError(f"`mode` must be 'sum' or 'ema'; got {mode!r}.")
        if bias_correction and mode != "ema":
            raise ValueError("`bias_correction` applies to `mode='ema'` (a weighted mean); use mode='ema'.")
        if mode == "ema" and not callable(factor) and float(factor) == 1.0:
            raise ValueError(
                "`factor=1` with `mode='ema'` gives every new window the weight 1 - factor = 0, so nothing would ever "
                "be learned (and bias correction would divide by 1 - 1 = 0). Use a factor < 1, or `mode='sum'` with "
                "factor=1 for plain accumulation across steps."
            )
        self.factor = factor
        self.mode = mode
        self.bias_correction = bias_correction
        self.save_residual = save_residual
        self.steps = 0  # optimizer steps taken with this policy
        self._residual: dict[int, list[Tensor | None]] = {}  # optimizer index -> G_{t-1} per parameter
        self._combined: dict[int, float] = {}  # optimizer index -> f used, for a step under way
        self._stepped: set[int] = set()
        self._optimizers: list[Optimizer] = []
        self._hooks: list[RemovableHandle] = []
        #: `grad_accum_dtype`: where the narrow parameters' window sums are; their residual is kept in that dtype, and
        #: G_t formed in it (`_wide_g`: optimizer index -> G_t of each narrow parameter, for a step under way)
        self._wide: WideSums | None = None
        self._wide_g: dict[int, dict[int, Tensor]] = {}

    def keep_wide(self, sums: WideSums | None) -> None:
        """Before ``attach``: the narrow parameters' window sums under ``grad_accum_dtype`` (``None``: none), whose
        residual is kept, and combined with the window's normalised sum, in the wide dtype, then rounded once."""
        self._wide = sums if sums is not None and sums.active else None

    def factor_at(self, step: int) -> float:
        """The decay factor for the window that ends with optimizer step ``step + 1``."""
        f = _check_factor(self.factor(step) if callable(self.factor) else self.factor)
        if f == 1.0 and self.mode == "ema":
            raise ValueError(
                f"`factor({step})` returned 1 with `mode='ema'`: the new window would get the weight 1 - 1 = 0. Return "
                "a factor < 1 in ema mode."
            )
        return f

    def settle(self, processed: bool) -> None:
        """After an exception: a step under way is finished if Lightning counts its batch as done
        (``processed``), else forgotten (the residual stays G_{t-1}). ``.grad`` is left as it is,
        for a checkpoint written next."""
        if self._combined and processed:
            self.after_step()
        self._combined.clear()
        self._stepped.clear()
        self._wide_g.clear()

    def attach(self, optimizers: Sequence[Optimizer]) -> None:
        """Start managing these optimizers' gradients (called at train start)."""
        seen: set[int] = set()
        for optimizer in optimizers:
            ids = {id(p) for p in gradients.optimizer_params(optimizer)}
            if ids & seen:
                raise ValueError(
                    "`GradientDecay` keeps one residual per optimizer, but two optimizers hold the same parameter, "
                    "which would get both residuals. Give each optimizer its own parameters."
                )
            seen |= ids
        self._optimizers = list(optimizers)
        for i, optimizer in enumerate(self._optimizers):
            self._hooks.append(optimizer.register_step_post_hook(lambda *_, i=i: self._stepped.add(i)))
            if i in self._residual:  # restored from a checkpoint: checked and put on the parameters' devices
                params = gradients.optimizer_params(optimizer)  # (a param group added since the checkpoint: none)
                saved = _fitted(self._residual[i], params)
                placed = gradients.placed(params, saved)
                if self._wide is not None:  # (a narrow parameter's residual kept in the wide dtype, as saved)
                    placed = [self._wide_residual(p, r, g) for p, r, g in zip(params, saved, placed, strict=True)]
                self._residual[i] = placed

    def detach(self, restore_residual: bool = True) -> None:
        """Stop managing; the residual goes back into ``.grad`` (unless the fit failed) so that it is
        visible after fit, on the parameter's device (Lightning's teardown may have moved the module)."""
        for i, optimizer in enumerate(self._optimizers):
            residual = self._residual.get(i) if restore_residual else None
            if residual is not None:
                params = gradients.optimizer_params(optimizer)
                for p, r in zip(params, _fitted(residual, params), strict=True):
                    if p.grad is None and r is not None:
                        p.grad = r.to(device=p.device, dtype=p.dtype)
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._optimizers = [], []

    def combine(self, optimizer: Optimizer) -> None:
        """``.grad`` <- G_t from the window's gradient and the residual (bias-corrected if asked); under
        ``grad_accum_dtype`` a narrow parameter's G_t is formed from its normalised wide sum and its wide residual,
        and rounded into ``.grad`` once."""
        i = self._index(optimizer)
        params = gradients.optimizer_params(optimizer)
        new = [p.grad for p in params]
        if all(g is None for g in new):  # a window nothing went into is not stepped: the residual waits
            return
        narrow = self._widen(params, new)
        f = self.factor_at(self.steps)
        _mix(new, _fitted(self._residual.get(i) or [], params), f, self.mode)
        if self.bias_correction:
            gradients.scale_([g for g in new if g is not None], 1.0 / (1.0 - f ** (self.steps + 1)))
        _into_grad(params, new)
        self._wide_g[i] = {j: new[j] for j in narrow if new[j] is not None}  # type: ignore[misc]
        self._combined[i] = f

    def _widen(self, params: Sequence[Tensor], new: list[Tensor | None]) -> list[int]:
        """Under ``grad_accum_dtype``: the narrow parameters' window gradient, normalised in the wide dtype, in
        ``new`` (where it has one); their indices."""
        wide = self._wide
        if wide is None:
            return []
        narrow = [j for j, p in enumerate(params) if wide.holds(p)]
        for j in narrow:
            new[j] = wide.normalised(params[j])
        return narrow

    def after_step(self) -> None:
        """Move G_t aside as the next residual (or keep the old one if the step was skipped)."""
        if not self._combined:
            return
        stepped_any = False
        for i, f in self._combined.items():
            params = gradients.optimizer_params(self._optimizers[i])
            if i in self._stepped:
                stepped_any = True
                held = self._wide_g.get(i, {})  # (a narrow parameter's G_t in the wide dtype; copied: the sums' buffer
                kept = [held[j].clone() if j in held else p.grad for j, p in enumerate(params)]  # is the next window's)
                if self.bias_correction:  # keep G_t, not the corrected gradient, as the residual
                    gradients.scale_([g for g in kept if g is not None], 1.0 - f ** (self.steps + 1))
                self._residual[i] = kept
            for p in params:  # the window's gradient leaves `.grad`: zero_grad and validation cannot touch it
                p.grad = None
        if stepped_any:
            self.steps += 1
        self._combined.clear()
        self._stepped.clear()
        self._wide_g.clear()

    def _wide_residual(self, p: Tensor, saved: Tensor | None, placed: Tensor | None) -> Tensor | None:
        """A narrow parameter's residual from a checkpoint in the wide dtype (as it was saved), any other's placed."""
        if saved is None or self._wide is None or not self._wide.holds(p):
            return placed
        return saved.to(device=p.device, dtype=self._wide.dtype, copy=True)

    def _index(self, optimizer: Optimizer) -> int:
        for i, o in enumerate(self._optimizers):
            if o is optimizer:
                return i
        raise RuntimeError("`GradientDecay` got an optimizer it was not attached to; attach it at train start.")

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"steps": self.steps}
        if self.save_residual:
            state["residual"] = {
                i: [None if r is None else r.detach().to("cpu", copy=True) for r in residual]
                for i, residual in self._residual.items()
            }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._combined.clear()  # nothing of a step that was under way when an earlier fit failed
        self._stepped.clear()
        self._wide_g.clear()
        self.steps = int(state_dict.get("steps", 0))
        self._residual = {int(i): list(r) for i, r in state_dict.get("residual", {}).items()}


def _mix(new: list[Tensor | None], residual: list[Tensor | None], f: float, mode: str) -> None:
    """G_t in ``new``, in place: the window's gradient plus ``f`` times the residual (``"sum"``), or
    ``(1 - f) g + f r`` (``"ema"``); a parameter with no gradient this window gets the residual alone, times ``f``
    (zeros if ``f`` is 0), one without a residual its gradient (times ``1 - f`` under ``"ema"``)."""
    grads: list[Tensor] = []  # (the gradients with a residual, and theirs; those without one)
    held: list[Tensor] = []
    alone: list[Tensor] = []
    for g, r in zip(new, residual, strict=True):
        if g is not None and r is not None:
            grads.append(g)
            held.append(r)
        elif g is not None:
            alone.append(g)
    if mode == "ema":  # one fused pass: lerp(g, r, f) = (1 - f) g + f r
        if grads:
            torch._foreach_lerp_(grads, held, f)
        gradients.scale_(alone, 1.0 - f)
    elif grads and f != 0.0:
        torch._foreach_add_(grads, held, alpha=f)
    for j, (g, r) in enumerate(zip(new, residual, strict=True)):
        if g is None and r is not None:  # no gradient in this window: the residual alone
            new[j] = r.mul_(f)


def _into_grad(params: Sequence[Tensor], new: Sequence[Tensor | None]) -> None:
    """Each parameter's G_t into its ``.grad`` (a narrow parameter's, formed in the wide dtype, rounded once)."""
    for p, g in zip(params, new, strict=True):
        if g is not None and p.grad is not g:
            p.grad = g if g.dtype == p.dtype else g.to(p.dtype)


def _fitted(residual: list[Tensor | None], params: Sequence[Tensor]) -> list[Tensor | None]:
    """The residual for the optimizer's parameters as they are now: a param group added during the fit (e.g. by
    ``BaseFinetuning``) comes after the residual's and has none yet."""
    if len(residual) > len(params):
        raise RuntimeError(
            f"`GradientDecay` holds a residual for {len(residual)} parameters, but the optimizer now has "
            f"{len(params)}: a param group was removed during the fit. Add param groups "
            "(`optimizer.add_param_group`), never remove them."
        )
    return residual + [None] * (len(params) - len(residual))


def _check_factor(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"`factor` must be a number in [0, 1] (0 zeroes, 1 keeps everything); got {value!r}.")
    return float(value)
