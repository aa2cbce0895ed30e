"""GradientDecay against the float64 reference: G_t = g_t + f G_{t-1} (sum), (1-f) g_t + f G_{t-1} (ema)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_resume import checkpoint_at

from lightning_accum import AccumulationScheduler, Constant, GradientDecay, Piecewise

from helpers import (
    ManualTokenModel,
    Reference,
    ResumableLoader,
    TokenData,
    TokenModel,
    count_tokens,
    loader,
    max_diff,
    params_of,
    rank_batches,
    trainer,
)

TOL = 1e-12
DECAYS = [(0.9, "sum", False), (0.5, "ema", False), (0.8, "ema", True), (1.0, "sum", False)]


@pytest.mark.parametrize("decay", DECAYS)
def test_alone_matches_reference(decay: tuple[float, str, bool]) -> None:
    data = TokenData(40)
    model = TokenModel(optimizer="adam", lr=0.01)
    f, mode, bias = decay
    trainer(callbacks=[GradientDecay(f, mode=mode, bias_correction=bias)], max_epochs=2).fit(model, loader(data, 4))
    expected, _ = Reference(Constant(1), decay=decay, optimizer="adam", lr=0.01).run([rank_batches(data, 4)] * 2)
    assert max_diff(params_of(model), expected) <= TOL
    plain, _ = Reference(Constant(1), optimizer="adam", lr=0.01).run([rank_batches(data, 4)] * 2)
    assert max_diff(params_of(model), plain) > 1e-4  # the decay really changed training


def test_factor_zero_is_zero_grad() -> None:
    data = TokenData(40)
    decayed, plain = TokenModel(), TokenModel()
    trainer(callbacks=[GradientDecay(0.0)], max_epochs=2).fit(decayed, loader(data, 4))
    trainer(max_epochs=2).fit(plain, loader(data, 4))
    assert max_diff(params_of(decayed), params_of(plain)) == 0.0


@pytest.mark.parametrize("normalize", ["mean", "items"])
def test_with_accumulation_scheduler(normalize: str) -> None:
    """Decay once per window, on the normalised window gradient (short windows included)."""
    schedule, data = Piecewise({0: 3, 4: 2}, unit="step"), TokenData(50)
    model = TokenModel(reduction="sum" if normalize == "items" else "mean")
    callbacks = [
        AccumulationScheduler(
            schedule, normalize=normalize, reduction="sum" if normalize == "items" else None, count=count_tokens
        ),
        GradientDecay(0.7, mode="ema", bias_correction=True),
    ]
    trainer(callbacks=callbacks, max_epochs=3, gradient_clip_val=0.5).fit(model, loader(data, 4))
    reference = Reference(schedule, normalize=normalize, decay=(0.7, "ema", True), clip=0.5)
    expected, _ = reference.run([rank_batches(data, 4)] * 3)
    assert max_diff(params_of(model), expected) <= TOL


@pytest.mark.parametrize("mode", ["backward", "heads"])
def test_as_mixin_reset(mode: str) -> None:
    schedule, data = Piecewise({0: 3, 4: 2}, unit="step"), TokenData(50)
    model = ManualTokenModel(mode=mode, schedule=schedule, reset=GradientDecay(0.6), gradient_clip_val=0.5)
    trainer(max_epochs=3).fit(model, loader(data, 4))
    expected, _ = Reference(schedule, decay=(0.6, "sum", False), clip=0.5).run([rank_batches(data, 4)] * 3)
    assert max_diff(params_of(model), expected) <= TOL


def test_residual_survives_validation() -> None:
    data = TokenData(40)
    model = TokenModel()

    class WithValidation(TokenModel):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val", float(batch["x"].sum()))

    model = WithValidation()
    t = trainer(callbacks=[GradientDecay(0.9)], max_epochs=2, val_check_interval=1, limit_val_batches=1)
    t.fit(model, loader(data, 4), loader(data, 4))
    expected, _ = Reference(Constant(1), decay=(0.9, "sum", False)).run([rank_batches(data, 4)] * 2)
    assert max_diff(params_of(model), expected) <= TOL


def test_residual_is_in_grad_after_fit_and_unused_parameters_stay_none() -> None:
    class WithUnused(TokenModel):
        def __init__(self) -> None:
            super().__init__()
            self.unused = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))

    model = WithUnused()
    trainer(callbacks=[GradientDecay(0.5)], max_epochs=1).fit(model, loader(TokenData(16), 4))
    assert model.unused.grad is None
    assert all(p.grad is not None for p in model.net.parameters())


@pytest.mark.parametrize("save_residual", [True, False])
def test_resume(tmp_path: Path, save_residual: bool) -> None:
    def run(ckpt: Path | None = None, resume: Path | None = None) -> TokenModel:
        model = TokenModel()
        callbacks: list[Any] = [AccumulationScheduler(2), GradientDecay(0.8, save_residual=save_residual)]
        if ckpt is not None:
            callbacks.append(
                ModelCheckpoint(dirpath=ckpt, every_n_train_steps=1, save_top_k=-1, filename="{epoch}-{step}")
            )
        t = trainer(callbacks=callbacks, max_epochs=2, enable_checkpointing=ckpt is not None)
        t.fit(model, ResumableLoader(TokenData(50), 4), ckpt_path=resume)
        return model

    full = run(ckpt=tmp_path)
    resumed = run(resume=checkpoint_at(tmp_path, 4))
    difference = max_diff(params_of(resumed), params_of(full))
    assert difference <= TOL if save_residual else difference > 1e-6


class SaveAfter(pl.Callback):
    """Saves a checkpoint after the ``at``-th training batch of the fit (1-based)."""

    def __init__(self, path: Path, at: int) -> None:
        self.path, self.at, self.batches = path, at, 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.batches += 1
        if self.batches == self.at:
            trainer.save_checkpoint(self.path)


class Joining(TokenModel):
    """The first layer frozen and outside the optimizer till ``join`` (an epoch's start, or a batch's), where it joins
    as a param group of its own (as `BaseFinetuning` does); resumed after that, the group is given back before
    Lightning loads the optimizer's state (as `BaseFinetuning` does in `on_fit_start`)."""

    def __init__(self, join: tuple[int, int]) -> None:
        super().__init__()
        self.join, self.joined = join, False
        self.net[0].requires_grad_(False)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD([p for p in self.net.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
        if self.joined:
            self._add(optimizer)
        return optimizer

    def _add(self, optimizer: torch.optim.Optimizer) -> None:
        self.net[0].requires_grad_(True)
        optimizer.add_param_group({"params": list(self.net[0].parameters())})

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if not self.joined and (self.current_epoch, batch_idx) == self.join:
            self.joined = True
            self._add(self.optimizers().optimizer)  # type: ignore[union-attr]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.joined = len(checkpoint["optimizer_states"][0]["param_groups"]) > 1


@pytest.mark.parametrize(
    ("join", "at"),
    [((1, 0), 8), ((0, 2), 2)],
    ids=["residual from before the join", "partial window from before the join"],
)
def test_resume_across_a_param_group_joining(tmp_path: Path, join: tuple[int, int], at: int) -> None:
    """A param group joins the optimizer during the fit (6 batches an epoch, windows of 3). A checkpoint written
    after the join, inside the window after it, holds the `GradientDecay` residual of the window before, over the
    first group's parameters; one written before the join, inside the window it joins, holds that window's partial
    gradient over them, and the resumed fit joins at the batch it resumes at, before the gradient is put back. Both
    resume to the uninterrupted fit; both were refused ("holds gradients for 2 parameters but the optimizer has 4")."""

    def run(extra: list[Any], resume: Path | None = None) -> TokenModel:
        model = Joining(join)
        callbacks = [AccumulationScheduler(3), GradientDecay(0.5), *extra]
        trainer(callbacks=callbacks, max_epochs=2).fit(model, ResumableLoader(TokenData(24), 4), ckpt_path=resume)
        return model

    path = tmp_path / "inside.ckpt"
    full = run([SaveAfter(path, at=at)])  # (after the `at`-th batch, inside a window)
    saved = torch.load(path, weights_only=False)
    assert len(saved["optimizer_states"][0]["param_groups"]) == (2 if join == (1, 0) else 1)
    assert max_diff(params_of(run([], resume=path)), params_of(full)) <= TOL


def test_skipped_step_keeps_the_residual() -> None:
    """An AMP step skipped for inf/nan never calls optimizer.step(): the old residual stays."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=1.0)
    decay = GradientDecay(0.5)
    decay.attach([opt])
    p.grad = torch.tensor([1.0, 2.0], dtype=torch.float64)
    decay.combine(opt)
    opt.step()
    decay.after_step()
    assert p.grad is None and decay.steps == 1
    p.grad = torch.tensor([float("inf"), 0.0], dtype=torch.float64)
    decay.combine(opt)  # the scaler would now skip opt.step()
    decay.after_step()
    assert decay.steps == 1 and torch.equal(decay._residual[0][0], torch.tensor([1.0, 2.0], dtype=torch.float64))
    p.grad = torch.tensor([4.0, 4.0], dtype=torch.float64)
    decay.combine(opt)
    assert torch.equal(p.grad, torch.tensor([4.5, 5.0], dtype=torch.float64))
    decay.detach()


def test_detach_takes_its_hooks_off_the_optimizers() -> None:
    """After ``detach`` the optimizer's steps are no longer seen: a step taken by hand between two fits of the same
    ``GradientDecay`` does not count as the next fit's step, whose skipped step (AMP, inf) keeps the residual; the
    optimizer's step hooks are back to those it had, and it no longer keeps the policy alive."""
    import gc
    import weakref

    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=1.0)
    hooks = (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks))
    decay = GradientDecay(0.5)
    decay.attach([opt])
    assert len(opt._optimizer_step_post_hooks) == hooks[1] + 1  # (the hook the test watches is there)
    p.grad = torch.tensor([1.0, 2.0], dtype=torch.float64)
    decay.combine(opt)
    opt.step()
    decay.after_step()
    decay.detach()  # (the fit's end: the residual G_1 = [1, 2] back in .grad)
    opt.step()  # by hand, between the fits
    opt.zero_grad(set_to_none=True)
    decay.attach([opt])  # the next fit: its first window's step skipped for inf
    p.grad = torch.tensor([float("inf"), 0.0], dtype=torch.float64)
    decay.combine(opt)
    decay.after_step()
    assert decay.steps == 1 and torch.equal(decay._residual[0][0], torch.tensor([1.0, 2.0], dtype=torch.float64))
    decay.detach()
    assert (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)) == hooks
    gone = weakref.ref(decay)
    del decay
    gc.collect()
    assert gone() is None  # (the optimizer holds nothing of it)


def test_a_fit_leaves_no_hook_on_its_optimizers() -> None:
    """The ``GradientDecay`` callback's fit ends with its optimizer's step hooks as they were when it was made."""

    class Counted(TokenModel):
        made: tuple[int, int] | None = None

        def configure_optimizers(self) -> Any:
            config = super().configure_optimizers()
            opt = config["optimizer"] if isinstance(config, dict) else config
            self.made = (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks))
            return config

    model = Counted()
    t = trainer(callbacks=[GradientDecay(0.5)], max_epochs=1)
    t.fit(model, loader(TokenData(8), 4))
    (opt,) = t.optimizers
    assert model.made is not None
    assert (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)) == model.made


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: GradientDecay(1.5), r"`factor` must be a number in \[0, 1\]"),
        (lambda: GradientDecay(-0.1), r"\[0, 1\]"),
        (lambda: GradientDecay(0.5, mode="max"), "`mode`"),
        (lambda: GradientDecay(0.5, bias_correction=True), "mode='ema'"),
        (lambda: GradientDecay(lambda step: 0.9, mode="ema", bias_correction=True), "constant `factor`"),
    ],
)
def test_construction_errors(make: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_factor_schedule_is_validated_when_used() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        trainer(callbacks=[GradientDecay(lambda step: 2.0)], max_epochs=1).fit(TokenModel(), loader(TokenData(8), 4))


@pytest.mark.parametrize(
    ("model", "callbacks", "match"),
    [
        (ManualTokenModel, [GradientDecay(0.5)], "reset="),
        (TokenModel, [GradientDecay(0.5), GradientDecay(0.7)], "more than one stateful callback"),
        (TokenModel, [GradientDecay(0.5), AccumulationScheduler(2)], "after `AccumulationScheduler`"),
    ],
)
def test_fit_start_errors(model: Any, callbacks: list[Any], match: str) -> None:
    m = model()
    before = params_of(m)
    with pytest.raises((ValueError, RuntimeError), match=match):
        trainer(callbacks=callbacks, max_epochs=1).fit(m, loader(TokenData(8), 4))
    assert max_diff(params_of(m), before) == 0.0


# (g, r, f, mode) -> G_t, per parameter: the rule `ResidualDecay.combine` applies (None: no gradient, no residual)
MIXES = [
    (2.0, 1.0, 0.5, "sum", 2.5),  # g + f r
    (2.0, 1.0, 0.0, "sum", 2.0),  # f = 0: the window's gradient as it is
    (2.0, 1.0, 1.0, "sum", 3.0),  # f = 1: plain accumulation across steps
    (2.0, 1.0, 0.25, "ema", 1.75),  # (1 - f) g + f r
    (2.0, None, 0.5, "sum", 2.0),  # no residual yet (a parameter group added mid-fit): the gradient
    (2.0, None, 0.25, "ema", 1.5),  # ... weighed as a new window under ema
    (None, 4.0, 0.5, "sum", 2.0),  # no gradient in this window: the residual alone, decayed
    (None, 4.0, 0.5, "ema", 2.0),
    (None, 4.0, 0.0, "sum", 0.0),  # (zeros at f = 0)
    (None, None, 0.5, "sum", None),  # neither: nothing
]


@pytest.mark.parametrize(("g", "r", "f", "mode", "expected"), MIXES)
def test_the_combined_gradient_table(
    g: float | None, r: float | None, f: float, mode: str, expected: float | None
) -> None:
    from lightning_accum._core.decay import _mix

    def tensor(v: float | None) -> torch.Tensor | None:
        return None if v is None else torch.tensor([v], dtype=torch.float64)

    new, residual = [tensor(g), tensor(1.0)], [tensor(r), tensor(3.0)]  # (beside a parameter with both)
    _mix(new, residual, f, mode)
    assert (None if new[0] is None else new[0].item()) == expected
    assert new[1].item() == (1.0 + f * 3.0 if mode == "sum" else (1 - f) * 1.0 + f * 3.0)  # type: ignore[union-attr]


@pytest.mark.parametrize(("returned", "refused"), [(1.0, True), (0.0, False), (0.5, False)])
def test_a_factor_function_returning_one_in_ema_mode_is_refused_at_that_step(returned: float, refused: bool) -> None:
    """``mode="ema"`` with a callable ``factor``: a window whose factor is 1 would get the weight 1 - 1 = 0, refused
    at the step it is returned for, naming the step; 0 (no memory) and 0.5 are taken."""
    from lightning_accum._core.decay import ResidualDecay

    decay = ResidualDecay(lambda step: returned if step == 3 else 0.5, mode="ema")
    assert decay.factor_at(2) == 0.5
    if refused:
        with pytest.raises(ValueError, match=r"`factor\(3\)` returned 1 with `mode='ema'`"):
            decay.factor_at(3)
    else:
        assert decay.factor_at(3) == returned


def test_each_combined_gradient_lands_in_its_parameters_grad() -> None:
    """``_into_grad``: a parameter without a combined gradient (none in the window, no residual) keeps its
    ``.grad`` (``None`` stays ``None``); one whose combined gradient is its ``.grad`` already keeps that tensor; a
    narrow parameter's gradient, formed in a wider dtype, lands rounded once to the parameter's dtype."""
    from lightning_accum._core.decay import _into_grad

    unused, same, narrow = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    narrow.data = narrow.data.bfloat16()
    same.grad = torch.ones(2)
    wide = torch.tensor([1.0 + 2**-10, 3.0], dtype=torch.float32)  # (1 + 2^-10 rounds to 1 in bf16)
    _into_grad([unused, same, narrow], [None, same.grad, wide])
    kept = same.grad
    assert unused.grad is None and same.grad is kept
    assert narrow.grad is not None and narrow.grad.dtype == torch.bfloat16
    assert narrow.grad.tolist() == [1.0, 3.0]


@pytest.mark.parametrize("state", [{}, {"residual": {}}], ids=["empty", "no-steps"])
def test_a_state_without_steps_loads_as_a_fresh_policy(state: dict[str, Any]) -> None:
    """A state with no ``steps`` entry counts no step taken: the first bias-corrected step's gradient is the window's
    own, G_1 = (1 - f) g / (1 - f^1) = g."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=1.0)
    decay = GradientDecay(0.5, mode="ema", bias_correction=True)
    decay.load_state_dict(state)
    decay.attach([opt])
    p.grad = torch.tensor([1.0, -3.0], dtype=torch.float64)
    decay.combine(opt)
    assert decay.steps == 0 and torch.equal(p.grad, torch.tensor([1.0, -3.0], dtype=torch.float64))
    decay.detach()


def test_a_checkpointed_residual_is_kept_wide_only_for_a_parameter_the_wide_sums_hold() -> None:
    """Under ``grad_accum_dtype``: a narrow parameter the sums hold gets its residual back in the wide dtype, as it
    was saved; one they do not hold (frozen, so not summed) keeps it in its own dtype, as its ``.grad`` path forms
    G_t."""
    from lightning_accum._core.wide import WideSums

    held, frozen = (torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)) for _ in range(2))
    frozen.requires_grad_(False)
    opt = torch.optim.SGD([held, frozen], lr=1.0)
    sums = WideSums(torch.float32)
    sums.attach([held, frozen])
    decay = GradientDecay(0.5)
    decay.keep_wide(sums)
    third = torch.tensor([1 / 3, 1.0], dtype=torch.float32)  # (1/3 is not a bf16 number)
    decay.load_state_dict({"steps": 1, "residual": {0: [third, third.to(torch.bfloat16)]}})
    decay.attach([opt])
    residual = decay._residual[0]
    assert [r.dtype for r in residual] == [torch.float32, torch.bfloat16]  # type: ignore[union-attr]
    assert torch.equal(residual[0], third) and torch.equal(residual[1], third.to(torch.bfloat16))  # type: ignore[arg-type]
    decay.detach(restore_residual=False)
