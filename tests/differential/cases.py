"""Named regression cases: each a configuration that diverged from the reference (or crashed)
before its fix, kept as the fuzzer prints them (fields left at their defaults omitted)."""

from __future__ import annotations

from typing import Any

from .configs import Config

_ITEMS = {"normalize": "items", "count": True}
_EMPTY_WINDOW = {**_ITEMS, "n": 24, "schedule": {"family": "constant", "k": 2}, "empty_batches": [2, 3]}  # batches of 4
_BF16 = {"precision": "bf16-true"}
_WIDE = {"precision": "bf16-true", "grad_accum_dtype": "float32"}

CASES: dict[str, dict[str, Any]] = {
    # issue 21, 3: a hand-written masked mean over a micro-batch without items made every parameter NaN
    "masked_mean_without_items_callback": {**_ITEMS, "reduction": "mean", "empty_batches": [1, 4]},
    "masked_mean_without_items_mixin": {**_ITEMS, "adapter": "mixin", "reduction": "mean", "empty_batches": [1, 4]},
    # issue 21, 12: `acc.backward(mean, items=0)` with a plain int failed inside autograd
    "items_int_zero_mixin": {**_ITEMS, "adapter": "mixin", "mode": "items_int", "reduction": "mean",
                             "empty_batches": [0, 3]},
    # issue 21, 4: two failures in a row (Lightning's totals counted the retried batch twice)
    "two_failures_callback": {"n": 40, "schedule": {"family": "constant", "k": 3}, "epochs": 1,
                              "interruptions": [["on_train_batch_start", 0, 3], ["on_train_batch_end", 0, 7]]},
    "two_failures_mixin": {"adapter": "mixin", "n": 40, "schedule": {"family": "constant", "k": 3}, "epochs": 1,
                           "interruptions": [["training_step", 0, 3], ["on_train_batch_end", 0, 7]]},
    # a failure, then a checkpoint at the next epoch's last batch (the epoch was counted as not started)
    "resumes_at_two_epoch_ends": {"n": 30, "epochs": 3, "schedule": {"family": "constant", "k": 1},
                                  "interruptions": [["save", 0, 7], ["save", 1, 7]]},
    # SIGTERM at an epoch's last batch (with `max_steps`): the resumed fit continued the next epoch at batch
    # index `len`, and ended it after one batch
    "sigterm_at_epoch_end_callback": {"n": 28, "schedule": {"family": "constant", "k": 2}, "max_steps": 11,
                                      "interruptions": [["sigterm", 0, 6]]},
    "sigterm_at_epoch_end_mixin": {"adapter": "mixin", "n": 28, "schedule": {"family": "constant", "k": 2},
                                   "max_steps": 11, "interruptions": [["sigterm", 0, 6]]},
    # issue 21, 8: a window nothing went into under GradientDecay stepped with the decayed residual (callback)
    "decay_empty_window_callback": {**_EMPTY_WINDOW, "decay": [0.5, "sum", False]},
    "decay_empty_window_mixin": {**_EMPTY_WINDOW, "adapter": "mixin", "decay": [0.5, "sum", False]},
    # a window nothing went into counted as a step (global_step, step-interval schedulers)
    "empty_window_counts_no_step": {**_EMPTY_WINDOW, "scheduler": {"kind": "step", "interval": "step", "step_size": 1}},
    # issue 21, 10: clipping by value of a window nothing went into crashed inside torch
    "clip_value_empty_window": {**_EMPTY_WINDOW, "clip": [0.5, "value"]},
    # issue 21, 11: the mixin stepped no epoch-interval scheduler, and ReduceLROnPlateau failed
    "mixin_epoch_scheduler": {"adapter": "mixin", "epochs": 3, "scheduler": {"kind": "step", "interval": "epoch",
                                                                             "step_size": 1}},
    "mixin_plateau": {"adapter": "mixin", "epochs": 3, "optimizer": "momentum", "lr": 0.5,
                      "scheduler": {"kind": "plateau"}},
    # the mixin's epoch scheduler stepped at the epoch's end, after a checkpoint at its last batch
    "mixin_epoch_scheduler_resumed": {"adapter": "mixin", "epochs": 3, "n": 11, "batch_size": 4, **_ITEMS,
                                      "reduction": "mean", "scheduler": {"kind": "step", "interval": "epoch",
                                                                          "step_size": 1},
                                      "interruptions": [["on_after_backward", 1, 1]]},
    # ReduceLROnPlateau skipped at the end of an epoch resumed mid-way (Lightning's `restarting` flag)
    "plateau_resumed_mid_epoch": {"seed": 117, "n": 13, "batch_size": 2, "epochs": 3, "optimizer": "adam", "lr": 0.01,
                                  "schedule": {"family": "constant", "k": 1}, "scheduler": {"kind": "plateau"},
                                  "interruptions": [["on_train_batch_end", 1, 3]]},
    # a batch trained again after a resume (its gradient already in the window), then a failure inside its
    # window's step after the rescale: the checkpoint kept the rescaled window, without a warning
    "redone_batch_then_failure_in_its_step": {"seed": 681, "n": 27, "schedule": {"family": "constant", "k": 2},
                                              "interruptions": [["on_after_backward", 0, 5],
                                                                ["on_before_optimizer_step", 0, 5]]},
    # two optimizers in one window sharing a parameter: its gradient was rescaled once per optimizer
    "two_optimizers_sharing_a_parameter": {"adapter": "mixin", "optimizers": 2, "shared": True, "n": 22,
                                           "schedule": {"family": "constant", "k": 4}},
    # issue 32: the cached loss in blocks of samples, chunks packed by tokens (padding trimmed, no row cap on the
    # first tower), a frozen guide tower run once; with batches of no items, and through a resume
    "cached_blocks_tokens_frozen_guide": {
        "adapter": "mixin", "mode": "cached", "n": 13, **_ITEMS, "reduction": "sum", "empty_batches": [1],
        "schedule": {"family": "constant", "k": 2}, "chunks": [None, 2], "chunk_tokens": [3, 2], "loss_chunk": 3,
        "guide": "frozen", "interruptions": [["on_after_backward", 0, 2]]},
    "cached_blocks_no_grad_guide": {"adapter": "mixin", "mode": "cached", "n": 14, "batch_size": 3, "epochs": 1,
                                    "schedule": {"family": "constant", "k": 3}, "chunks": [1, 5], "loss_chunk": 2,
                                    "guide": "no_grad", "optimizer": "adam", "lr": 0.01},
    # issue 23: a plateau on `accum/loss` after a resume inside an epoch whose last window steps nothing saw no
    # value (Lightning keeps no logged metric across a resume; the uninterrupted run saw the last window's)
    "accum_loss_monitor_after_resume_mixin": {
        "adapter": "mixin", "batch_size": 3, **_ITEMS, "empty_batches": [2, 3], "epochs": 3, "n": 11, "seed": 52,
        "interruptions": [["save", 1, 2]], "optimizer": "adam", "lr": 0.01, "reduction": "mean",
        "schedule": {"family": "lambda", "fn": "epoch_up"}, "scheduler": {"kind": "plateau"}, "monitor": "accum/loss"},
    "accum_loss_monitor_after_resume_callback": {
        "batch_size": 3, **_ITEMS, "empty_batches": [2, 3], "epochs": 3, "n": 11, "seed": 52,
        "interruptions": [["save", 1, 2]], "optimizer": "adam", "lr": 0.01, "reduction": "mean",
        "schedule": {"family": "lambda", "fn": "epoch_up"}, "callbacks": ["early_stopping", "ema"],
        "scheduler": {"kind": "plateau"}, "monitor": "accum/loss"},
    # issue 26: a Fabric checkpoint at an epoch's last batch, resumed: `flush` stepped the window before its
    # partial gradient was put back (put back at the next block only)
    "fabric_resume_then_flush": {
        "adapter": "fabric", "batch_size": 2, "clip": [0.5, "norm"], "epochs": 2, "interruptions": [["save", 0, 2]],
        "limit_train_batches": 3, "lr": 0.01, "max_steps": 5, "n": 18, "optimizer": "adam", "seed": 699,
        "schedule": {"family": "constant", "k": 5}},
    # issue 30: two backward passes of one micro-batch counted its items twice (`reduction="mean"`: the gradient
    # halved, `Progress.items` doubled, an items-keyed schedule twice as fast)
    "fabric_two_passes_mean_loss": {
        "adapter": "fabric", **_ITEMS, "reduction": "mean", "passes": 2, "epochs": 2, "n": 26, "seed": 7,
        "schedule": {"family": "ramp", "start": 1, "end": 4, "over": 80, "unit": "items"}},
    # issue 30: `state_dict` right after `load_state_dict` (before the next block) saved no partial gradient
    "fabric_saved_again_right_after_a_load": {
        "adapter": "fabric", **_ITEMS, "reduction": "sum", "epochs": 2, "n": 26, "seed": 8, "resave": True,
        "interruptions": [["save", 0, 3], ["save", 1, 1]], "schedule": {"family": "constant", "k": 3}},
    # issue 30: an `lr_schedule` keyed on epochs without `epoch=` stayed at epoch 0 (refused now, then given)
    "fabric_epoch_lr_schedule_without_epoch": {
        "adapter": "fabric", "epochs": 3, "n": 20, "epoch_arg": False, "schedule": {"family": "constant", "k": 2},
        "lr_schedule": {"warmup": 1, "total": 3, "unit": "epoch", "final": 0.0}},
    # issue 30: FSDP2 in a Fabric loop trained wrong parameters (or none); DDP resumed inside a window, the
    # checkpoint refused on one process
    "fabric_fsdp2_two_ranks": {
        "adapter": "fabric", **_ITEMS, "reduction": "mean", "world": 2, "strategy": "fsdp2", "last_arg": True,
        "epochs": 2, "n": 31, "seed": 11, "clip": [0.05, "norm"], "optimizer": "adam", "lr": 0.01,
        "interruptions": [["save", 0, 1]], "schedule": {"family": "ramp", "start": 1, "end": 3, "over": 40,
                                                        "unit": "items"}},
    "fabric_ddp_two_ranks_resumed_inside_a_window": {
        "adapter": "fabric", "world": 2, "epochs": 2, "n": 32, "seed": 12, "passes": 2, "resave": True,
        "interruptions": [["save", 0, 1], ["save", 1, 2]], "schedule": {"family": "constant", "k": 3}},
    # issue 31, 1: a scheduler the model steps itself (Lightning's manual optimization) was stepped by the mixin too
    "mixin_scheduler_stepped_by_the_model_per_window": {
        "adapter": "mixin", "n": 30, "schedule": {"family": "ramp", "start": 1, "end": 3, "over": 4, "unit": "step"},
        "scheduler": {"kind": "step", "interval": "step", "step_size": 1}, "schedulers_by": "user",
        "empty_batches": [3], **_ITEMS, "interruptions": [["on_after_backward", 0, 4]]},
    "mixin_scheduler_stepped_by_the_model_per_epoch": {
        "adapter": "mixin", "epochs": 3, "scheduler": {"kind": "step", "interval": "epoch", "step_size": 1},
        "schedulers_by": "user", "max_steps": 7},
    "mixin_plateau_stepped_by_the_model": {"adapter": "mixin", "epochs": 3, "optimizer": "momentum", "lr": 0.5,
                                           "scheduler": {"kind": "plateau"}, "schedulers_by": "user",
                                           "probe_in": "module"},
    # ... and stepped by both: refused
    "mixin_scheduler_stepped_by_both_is_refused": {
        "adapter": "mixin", "scheduler": {"kind": "step", "interval": "step", "step_size": 2}, "schedulers_by": "both"},
    # issue 31, 2: the mixin stepped an epoch's plateau before the module's `on_train_epoch_end`, where the metric is
    # logged (refused at epoch 0 with `strict=True`, one epoch stale otherwise)
    "mixin_plateau_on_a_metric_the_module_logs": {"adapter": "mixin", "epochs": 3, "optimizer": "momentum", "lr": 0.5,
                                                  "scheduler": {"kind": "plateau"}, "probe_in": "module"},
    # issue 31, 4: windows of their own for two optimizers, k = 1 at first: the first optimizer's first window went
    # to `accum/loss`, the others to `accum/opt0/loss`; monitors on it missed the first epoch's (a batch an epoch)
    "windows_of_their_own_from_k1_watched": {
        "adapter": "mixin", "optimizers": 2, "windows": "each", "epochs": 4, "n": 20, "limit_train_batches": 1,
        "optimizer": "momentum", "lr": 3.0,
        "schedule": {"family": "piecewise", "unit": "step", "milestones": [[0, 1], [2, 2]]},
        "callbacks": ["early_stopping", "ema"], "monitor": "accum/loss", "scheduler": {"kind": "plateau"}},
    # issue 31, 5: batches skipped by returning None (the first and the epoch's last included: its window is cut there)
    "skipped_batches_mixin": {"adapter": "mixin", "n": 26, "batch_size": 3, "schedule": {"family": "constant", "k": 3},
                              "skip": [0, 4, 7, 8], "epochs": 2, "callbacks": ["ema"],
                              "interruptions": [["save", 0, 5]]},
    # issue 31, 8: `estimated_stepping_batches` in `configure_optimizers` with `GradientDecay` alone, resumed inside an
    # epoch, trained the epoch's first batches again
    "decay_alone_estimated_and_resumed": {"plain": True, "schedule": {"family": "constant", "k": 1}, "estimate": True,
                                          "decay": [0.5, "sum", False], "n": 20, "epochs": 2,
                                          "interruptions": [["save", 1, 2]]},
    # the adversarial pass after issue 31, 1: a step-interval plateau on a metric logged after the block was stepped
    # as the block exited (refused at the first window with `strict=True`, one batch old otherwise); Lightning steps
    # it after the batch's end hooks and validation (the callback, in Lightning's own loop, always did)
    "mixin_step_plateau_on_a_metric_logged_after_the_batch": {
        "adapter": "mixin", "n": 24, "epochs": 2, "schedule": {"family": "constant", "k": 2}, "optimizer": "momentum",
        "lr": 0.5, "val_every": 3, "scheduler": {"kind": "plateau", "interval": "step"}},
    "callback_step_plateau_on_a_metric_logged_after_the_batch": {
        "n": 24, "epochs": 2, "schedule": {"family": "constant", "k": 2}, "optimizer": "momentum", "lr": 0.5,
        "val_every": 3, "scheduler": {"kind": "plateau", "interval": "step"}},
    "mixin_step_plateau_windows_of_their_own": {
        "adapter": "mixin", "n": 24, "optimizers": 2, "windows": "each", "epochs": 2, "optimizer": "momentum",
        "lr": 0.5, "schedule": {"family": "constant", "k": 2}, "scheduler": {"kind": "plateau", "interval": "step"}},
    # ... 4: `zero_grad()` left in `training_step` threw each window's earlier micro-batches away: refused
    "mixin_zero_grad_in_training_step_is_refused": {"adapter": "mixin", "n": 24, "zero_grad": True,
                                                   "schedule": {"family": "constant", "k": 3}},
    # ... 3: a fit stopped inside a window left it open, and the next `trainer.fit` counted its micro-batches into its
    # first window (gradients at the old weights)
    "mixin_refit_after_a_stop_inside_a_window": {
        "adapter": "mixin", "n": 30, "epochs": 2, "refit": [0, 4], "optimizer": "adam", "lr": 0.01,
        "decay": [0.5, "sum", False], "lr_scaling": "linear",
        "schedule": {"family": "ramp", "start": 1, "end": 4, "over": 4, "unit": "step"}},
    # stop 40: the Fabric loop's `flush()` at an epoch's end stepped the step `max_steps` asked for, and the loop went
    # on into the next epoch (the runner's own check, after each block only)
    "fabric_max_steps_reached_by_an_epochs_flush": {
        "adapter": "fabric", "n": 7, "batch_size": 2, "epochs": 3, "max_steps": 6, "passes": 2,
        "schedule": {"family": "lambda", "fn": "cycle3"}},
    # stop 39: a callback reused by a new Trainer goes on from its progress (its schedule, first k and decay), as the
    # mixin's model does; a new one starts afresh
    "callback_reused_for_a_refit": {
        "adapter": "callback", "n": 30, "epochs": 2, "refit": [0, 4], "optimizer": "adam", "lr": 0.01,
        "decay": [0.5, "sum", False], "lr_scaling": "linear",
        "schedule": {"family": "ramp", "start": 1, "end": 4, "over": 4, "unit": "step"}},
    "mixin_refit_windows_of_their_own": {
        "adapter": "mixin", "n": 30, "epochs": 2, "refit": [0, 4], "optimizers": 2, "windows": "each",
        "schedule": {"family": "constant", "k": 3}, "scheduler": {"kind": "step", "interval": "step", "step_size": 1}},
    # issue 34: the readers of the window numbers change what a window computes (the loss read for a progress bar,
    # for a monitor its key alone between the epochs' ends, every key at a logger's step), never the training:
    # a bar, a plateau and early stopping on `accum/loss`, a logger, tensor counts, a failure and a resume
    "readers_bar_monitor_logger": {
        **_ITEMS, "reduction": "mean", "empty_batches": [3], "n": 30, "epochs": 2,
        "schedule": {"family": "constant", "k": 3}, "scheduler": {"kind": "plateau"}, "monitor": "accum/loss",
        "callbacks": ["progress_bar", "early_stopping", "lr_monitor"], "interruptions": [["on_after_backward", 0, 5]]},
    # every option at once, through two resumes
    "everything": {"adapter": "callback", "n": 27, "batch_size": 3, "epochs": 3, **_ITEMS, "reduction": "mean",
                   "schedule": {"family": "ramp", "start": 1, "end": 3, "over": 60, "unit": "items"},
                   "empty_batches": [2], "optimizer": "adam", "lr": 0.01, "clip": [0.5, "norm"],
                   "lr_scaling": "sqrt", "lr_schedule": {"warmup": 2, "total": 10, "unit": "step", "final": 0.1},
                   "scheduler": {"kind": "step", "interval": "step", "step_size": 2},
                   "decay": [0.5, "ema", True], "val_every": 2, "callbacks": ["model_checkpoint", "lr_monitor"],
                   "interruptions": [["on_after_backward", 0, 4], ["save", 1, 5]]},
    # issue 33: loader batches cut into pieces. "auto" backs off twice (4 -> 2 -> 1) inside backward passes (the
    # window redone), then a failure in the second piece of a batch: the resumed run trains the rest of it
    "pieces_out_of_memory_then_failure_in_a_piece": {
        "n": 26, "batch_size": 4, "epochs": 2, **_ITEMS, "reduction": "mean", "empty_batches": [3], "seed": 5,
        "schedule": {"family": "constant", "k": 3}, "decay": [0.5, "sum", False], "microbatch_size": "auto",
        "oom": [1, "backward"], "interruptions": [["training_step", 0, 4], ["save", 1, 2]], "fail_piece": 1},
    # pieces with everything around them: validation inside windows, a plateau on `accum/loss`, clipping, SWA's
    # BatchNorm-free epochs, a failure inside Lightning's backward (which reaches no parameter)
    "pieces_with_lightning_around": {
        "n": 22, "batch_size": 4, "epochs": 3, "schedule": {"family": "ramp", "start": 1, "end": 3, "over": 4,
        "unit": "step"}, "microbatch_size": 3, "val_every": 2, "clip": [0.05, "norm"], "optimizer": "adam",
        "lr": 0.01, "callbacks": ["ema"], "interruptions": [["on_before_backward", 0, 3]]},
    "pieces_swa": {"n": 20, "batch_size": 4, "epochs": 3, "microbatch_size": 3, "swa": [0.05, 2],
                   "schedule": {"family": "constant", "k": 2}},
    # issue 35, 6: the mixin's `reduction="mean"`: token means weighted by `count(batch)` on every path, batches
    # without tokens (NaN) adding nothing: through a shared trunk (its gradient sent on by hand), a failure inside
    # a backward resumed; the cached loss in blocks of rows; parts of `backward_microbatches` by `count(part)`
    "mixin_reduction_mean_heads": {
        **_ITEMS, "adapter": "mixin", "mode": "heads", "reduction": "mean", "mean_by": "reduction",
        "empty_batches": [1, 4], "schedule": {"family": "constant", "k": 3},
        "interruptions": [["on_after_backward", 0, 4]]},
    "mixin_reduction_mean_cached_blocks": {
        **_ITEMS, "adapter": "mixin", "mode": "cached", "reduction": "mean", "mean_by": "reduction", "loss_chunk": 2,
        "chunks": [2, 3], "empty_batches": [2], "schedule": {"family": "ramp", "start": 1, "end": 3, "over": 60,
        "unit": "items"}},
    "mixin_reduction_mean_microbatches": {
        **_ITEMS, "adapter": "mixin", "mode": "microbatches", "reduction": "mean", "mean_by": "reduction", "n": 23,
        "batch_size": 3, "empty_batches": [0, 3], "schedule": {"family": "constant", "k": 2}, "optimizer": "adam",
        "lr": 0.01},
    # a `training_step` returning `None` under the callback, resumed inside a window whose later batches return
    # `None` (its saved gradient was put back only at the next backward pass: into the next window), or whose
    # epoch a window of only `None` batches ends (nothing went in: no step)
    "none_after_resume_callback": {"n": 28, "schedule": {"family": "constant", "k": 3}, "skip": [5],
                                   "interruptions": [["save", 0, 4]], "optimizer": "adam", "lr": 0.01},
    "none_window_callback": {**_ITEMS, "n": 28, "schedule": {"family": "constant", "k": 2}, "skip": [4, 5, 6],
                             "scheduler": {"kind": "step", "interval": "step", "step_size": 1}},
    # issue 42: a param group added inside a window lost the window's first loader batch under `microbatch_size`;
    # a `training_step` that takes the mask out of its batch changed the pieces' counts (and "auto" redid a batch
    # whose whole first try had lost it)
    "unfreeze_inside_a_window_pieces": {"n": 28, "schedule": {"family": "constant", "k": 3}, "microbatch_size": 3,
                                        "unfreeze": [0, 4], "optimizer": "momentum"},
    "mutated_batch_pieces": {**_ITEMS, "reduction": "mean", "n": 28, "schedule": {"family": "constant", "k": 2},
                             "microbatch_size": 2, "mutate": True, "unfreeze": [1, 0]},
    "mutated_batch_auto_redo": {**_ITEMS, "reduction": "mean", "n": 28, "schedule": {"family": "constant", "k": 2},
                                "microbatch_size": "auto", "oom": [2, "backward"], "mutate": True},
    # issue 42: `NoiseScale` and AdaScale in the fuzzer. The mixin's two optimizers sharing the last layer's bias: its
    # gradient counted twice in the noise probe's norms (k 5 against 3); ...
    "noise_two_optimizers_sharing_a_parameter": {
        "adapter": "mixin", "seed": 796, "n": 27, "batch_size": 2, "epochs": 3, "optimizers": 2, "shared": True,
        "schedule": {"family": "noise", "min_k": 2, "max_k": 5, "start": 2, "every": 1, "warmup": 3,
                     "hysteresis": 0.0, "beta": 0.0, "max_ratio": 2.0}},
    # ... a first window of no items (not stepped) was AdaScale's base batch: B_0 = 0, the gain 1 ever after
    "adascale_after_an_empty_first_window": {
        **_ITEMS, "seed": 186, "n": 13, "batch_size": 2, "epochs": 3, "reduction": "mean", "empty_batches": [0, 3],
        "skip": [1], "microbatch_size": 1, "lr_scaling": "adascale",
        "schedule": {"family": "piecewise", "unit": "samples", "milestones": [[8, 3], [21, 2], [25, 3]]}},
    # everything around a measuring window on one process: resumed inside windows and after a failure, decay,
    # clipping, AdaScale keyed on its scaled steps
    "noise_and_adascale_resumed": {
        **_ITEMS, "n": 30, "batch_size": 2, "epochs": 2, "reduction": "mean", "empty_batches": [3],
        "schedule": {"family": "noise", "min_k": 2, "max_k": 6, "every": 1, "warmup": 1, "hysteresis": 0.0,
                     "beta": 0.5, "max_ratio": 2.0},
        "lr_scaling": "adascale", "lr_schedule": {"warmup": 2, "total": 8, "unit": "scaled_steps", "final": 0.1},
        "decay": [0.5, "sum", False], "clip": [0.5, "norm"], "optimizer": "adam", "lr": 0.01,
        "interruptions": [["on_after_backward", 0, 4], ["save", 1, 3]]},
    # (fuzzer, seed 52) BatchNorm over the window with pieces: a piece failed in training_step and the fit resumed
    # from the on-exception checkpoint; the finished pieces' statistics were dropped, their gradient kept
    "batchnorm_pieces_failed_and_resumed": {
        "seed": 457,
         "n": 12,
         "schedule": {"beta": 0.995,
                      "every": 3,
                      "family": "noise",
                      "hysteresis": 0.0,
                      "max_k": 3,
                      "max_ratio": 2.0,
                      "min_k": 2,
                      "warmup": 1},
         "normalize": "items",
         "reduction": "mean",
         "count": True,
         "empty_batches": [1, 2],
         "lr_scaling": "adascale",
         "scheduler": {"interval": "step", "kind": "step", "step_size": 1},
         "decay": [0.5, "sum", False],
         "interruptions": [["save", 0, 1], ["training_step", 1, 0]],
         "microbatch_size": 2,
         "fail_piece": 1,
         "mutate": True,
         "batchnorm": "window",
         "bn_momentum": None},
    # issue 46: windows closed by a budget. A failure before a batch's backward: the count the budget took of it as it
    # started was counted again when it was trained again (a window closed a batch early)
    "budget_failed_batch_counted_once": {"n": 28, "batch_size": 2, "epochs": 1, "interruptions": [
        ["on_train_batch_start", 0, 0], ["training_step", 0, 3]],
        "schedule": {"family": "budget", "n": 4, "unit": "samples", "max_k": None}},
    # a ramping budget of tokens with `max_k`, batches returning `None` (counted, as k counts them), resumed inside a
    # window, `lr_scaling` relative to the first budget
    "budget_ramp_none_losses_resumed": {
        **_ITEMS, "n": 30, "batch_size": 3, "epochs": 2, "skip": [2, 5], "lr_scaling": "linear",
        "schedule": {"family": "budget", "n": {"family": "ramp", "start": 8, "end": 30, "over": 6, "unit": "step"},
                     "unit": "items", "max_k": 3},
        "interruptions": [["save", 0, 3], ["on_after_backward", 1, 4]]},
    "budget_mixin_decay": {**_ITEMS, "adapter": "mixin", "mode": "each", "n": 30, "batch_size": 3,
                           "decay": [0.5, "sum", False], "schedule": {"family": "budget", "n": 20, "unit": "items"},
                           "interruptions": [["save", 1, 2]]},
    "budget_fabric_two_passes": {**_ITEMS, "adapter": "fabric", "passes": 2, "n": 26, "batch_size": 2,
                                 "schedule": {"family": "budget", "n": 9, "unit": "items", "max_k": 4},
                                 "interruptions": [["save", 0, 5]], "resave": True},
    # (fuzzer, seed 53) AdaScale over `NoiseScale`'s estimates with pieces: a failure in `on_before_backward` of a
    # window's first batch (its pieces' backward passes done, the batch counted) and a resume from the on-exception
    # checkpoint; the batch, trained again, added nothing, and the prefix after it was never taken: the window
    # measured nothing (0.0107 off, the LRs from the 4th step on)
    "noise_adascale_pieces_failed_before_backward": {
        **_ITEMS, "seed": 214, "n": 21, "batch_size": 3, "microbatch_size": 2, "reduction": "mean",
        "lr_scaling": "adascale", "probe_in": "module", "interruptions": [["on_before_backward", 0, 4]],
        "schedule": {"family": "noise", "min_k": 2, "max_k": 3, "start": 2, "every": 1, "warmup": 2,
                     "hysteresis": 0.0, "max_ratio": 4.0, "beta": 0.9}},
    # issue 53: under `batchnorm="window"` a batch whose `training_step` ran its forward and returned `None` (the first
    # piece, with `microbatch_size`) counts in its window's statistics; they were left out (the run without the batch)
    "skip_forward_window_callback_pieces": {
        "batchnorm": "window", "microbatch_size": 2, "n": 24, "skip": [1, 4, 5], "skip_forward": True,
        "schedule": {"family": "constant", "k": 3}, "interruptions": [["save", 0, 4]]},
    # the mixin's blocks that make no backward pass: one in the place of the window's k-th closes it, a window of
    # them only (at the epoch's end) advances the statistics unstepped (one device: it was dropped)
    "skip_forward_window_mixin_k": {
        "adapter": "mixin", "batchnorm": "window", "bn_momentum": None, "n": 22, "batch_size": 2, "epochs": 1,
        "skip": [2, 9, 10], "skip_forward": True, "schedule": {"family": "constant", "k": 3}},
    # (fuzzer, seed 0) a window holding a block without a pass only, then a block whose pass raised (in
    # `on_after_backward`): the window was dropped, "nothing lost", with that block's statistics and the budget's count
    "skip_forward_window_mixin_failed_after_pass": {
        "adapter": "mixin", "mode": "heads", "batchnorm": "window", "bn_momentum": 0.5, "seed": 891, "n": 23,
        "batch_size": 2, "epochs": 1, "limit_train_batches": 10, "skip": [2, 4, 5, 7, 8], "skip_forward": True,
        "schedule": {"family": "budget", "n": 4, "unit": "samples", "max_k": None},
        "interruptions": [["on_after_backward", 0, 3]]},
    # a budget window of count 0 (batches without tokens, closed by `max_k`) under `normalize="mean"`: stepped with the
    # guide's LR factor, 0, not 1.0
    "budget_zero_count_window_lr_scaling": {
        "count": True, "n": 16, "batch_size": 4, "empty_batches": [1, 2], "lr_scaling": "linear",
        "schedule": {"family": "budget", "n": 6, "unit": "items", "max_k": 2}},
    # issue 53, item 4: a param group joining during the fit (`unfreeze`) beside a resume, `GradientDecay`, SWA, two
    # optimizers and the mixin. Found: a checkpoint inside a window written before the group joined, resumed at the
    # batch it joins at, refused its own partial gradient ("holds gradients for 2 parameters but the optimizer has
    # 4"); and a `GradientDecay` residual taken before the join, in a checkpoint written after it (the optimizer with
    # the group), refused the same way as the fit resumed
    "unfreeze_resumed_at_the_join": {"n": 8, "batch_size": 2, "schedule": {"family": "constant", "k": 3},
                                     "unfreeze": [0, 2], "interruptions": [["save", 0, 1]]},
    "unfreeze_decay_resumed_after_the_join": {"n": 24, "schedule": {"family": "constant", "k": 3},
                                              "decay": [0.5, "ema", True], "unfreeze": [0, 4],
                                              "interruptions": [["save", 0, 4]], "optimizer": "momentum"},
    "unfreeze_mixin_decay_resumed": {"adapter": "mixin", "mode": "microbatches", "n": 24,
                                     "schedule": {"family": "constant", "k": 3}, "decay": [0.9, "sum", False],
                                     "unfreeze": [0, 4], "interruptions": [["on_after_backward", 1, 2]]},
    "unfreeze_mixin_two_optimizers": {**_ITEMS, "adapter": "mixin", "mode": "each", "optimizers": 2, "shared": True,
                                      "n": 24, "schedule": {"family": "constant", "k": 2}, "optimizer": "adam",
                                      "lr": 0.01, "unfreeze": [0, 3], "interruptions": [["save", 0, 4]]},
    "unfreeze_before_swa": {"n": 24, "epochs": 3, "swa": [0.05, 2], "schedule": {"family": "constant", "k": 2},
                            "unfreeze": [0, 3], "decay": [0.5, "sum", False]},
    # issue 51: `precision="bf16-true"`, with `grad_accum_dtype="float32"` (`_WIDE`: each window's gradient the exact
    # one rounded to bf16 once, bar float32's ties) and without it (`_BF16`: bf16 sums in `.grad`, bit for bit), in
    # every adapter and backward form, each step's gradient compared before clipping (`bf16_reference.py`). Found:
    # without the option, a window's correction (k over what went in) multiplied bf16 gradients rounded to bf16 first
    # (`torch._foreach_mul_` on the CPU: 1/7 as 0.1426), in every adapter
    "bf16_mixin_microbatches_window_scale": {
        **_BF16, **_ITEMS, "adapter": "mixin", "mode": "microbatches", "reduction": "mean", "mean_by": "reduction",
        "batch_size": 2, "n": 8, "epochs": 1, "max_steps": 1, "clip": [1e-09, "value"], "seed": 65,
        "schedule": {"family": "lambda", "fn": "epoch_up"}},
    "bf16_callback_items_short_windows_resumed": {
        **_BF16, **_ITEMS, "n": 26, "batch_size": 3, "epochs": 2, "schedule": {"family": "constant", "k": 3},
        "optimizer": "adam", "lr": 0.01, "clip": [0.5, "norm"], "interruptions": [["save", 0, 4]]},
    # ... with the option, `microbatch_size="auto"` redoing a window after out-of-memory in backward counted its earlier
    # pieces twice (their float32 sums were not cleared with `.grad`)
    "bf16_wide_callback_auto_redone_window": {
        **_WIDE, **_ITEMS, "reduction": "mean", "n": 15, "batch_size": 3, "epochs": 3, "empty_batches": [1],
        "microbatch_size": "auto", "oom": [2, "backward"], "seed": 287, "interruptions": [["save", 0, 2]],
        "schedule": {"family": "lambda", "fn": "epoch_up"},
        "lr_schedule": {"final": 0.1, "total": 12, "unit": "step", "warmup": 3}},
    # ... and a param group joining a window (`BaseFinetuning`) was summed in bf16 `.grad`, not in float32
    "bf16_wide_callback_param_group_joins": {
        **_WIDE, "count": True, "batch_size": 3, "n": 26, "epochs": 1, "limit_train_batches": 3, "seed": 850,
        "batchnorm": "micro-batch", "bn_momentum": None, "lr_scaling": "sqrt", "optimizer": "momentum",
        "schedule": {"family": "budget", "max_k": None, "n": 23, "unit": "items"}, "unfreeze": [0, 1],
        "scheduler": {"interval": "step", "kind": "step", "step_size": 3}, "val_every": 1},
    # the option through pieces, a failure inside a window and a checkpoint (its float32 sums saved and put back)
    "bf16_wide_callback_pieces_resumed": {
        **_WIDE, **_ITEMS, "reduction": "mean", "n": 26, "batch_size": 3, "epochs": 2, "empty_batches": [2],
        "schedule": {"family": "constant", "k": 3}, "microbatch_size": 2, "optimizer": "momentum",
        "interruptions": [["on_after_backward", 0, 4], ["save", 1, 2]]},
    # the mixin's forms, with the option and without: a shared trunk, closures (two optimizers, one window), the cached
    # backward (token budgets, loss blocks, a frozen guide), a window per optimizer, `items=` ints
    "bf16_wide_mixin_heads_token_means": {
        **_WIDE, **_ITEMS, "adapter": "mixin", "mode": "heads", "reduction": "mean", "mean_by": "reduction", "n": 20,
        "empty_batches": [1], "schedule": {"family": "constant", "k": 3}, "interruptions": [["save", 0, 2]]},
    "bf16_mixin_each_two_optimizers": {
        **_BF16, "adapter": "mixin", "mode": "each", "optimizers": 2, "shared": True, "n": 22, "epochs": 2,
        "schedule": {"family": "constant", "k": 3}, "clip": [0.05, "value"], "optimizer": "adam", "lr": 0.01},
    "bf16_wide_mixin_cached_tokens_guide": {
        **_WIDE, **_ITEMS, "adapter": "mixin", "mode": "cached", "reduction": "sum", "n": 13, "empty_batches": [1],
        "schedule": {"family": "constant", "k": 2}, "chunks": [None, 2], "chunk_tokens": [3, 2], "loss_chunk": 3,
        "guide": "frozen", "interruptions": [["on_after_backward", 0, 2]]},
    "bf16_wide_mixin_windows_of_their_own": {
        **_WIDE, "adapter": "mixin", "optimizers": 2, "windows": "each", "n": 24, "epochs": 2, "optimizer": "momentum",
        "schedule": {"family": "ramp", "start": 1, "end": 4, "over": 6, "unit": "step"}, "clip": [0.5, "norm"]},
    "bf16_mixin_items_int_refit": {
        **_BF16, **_ITEMS, "adapter": "mixin", "mode": "items_int", "reduction": "mean", "n": 30, "epochs": 2,
        "empty_batches": [2], "refit": [0, 4], "schedule": {"family": "constant", "k": 3}},
    # Fabric: two passes a micro-batch, checkpoints saved again right after their load; a budget without the option
    "bf16_wide_fabric_two_passes_resaved": {
        **_WIDE, **_ITEMS, "adapter": "fabric", "reduction": "mean", "passes": 2, "n": 26, "epochs": 2, "resave": True,
        "interruptions": [["save", 0, 3], ["save", 1, 1]], "schedule": {"family": "constant", "k": 3},
        "clip": [0.5, "norm"]},
    "bf16_fabric_budget": {**_BF16, **_ITEMS, "adapter": "fabric", "passes": 2, "n": 26, "batch_size": 2,
                           "schedule": {"family": "budget", "n": 9, "unit": "items", "max_k": 4}},
    # 2 DDP ranks, the float32 sums all-reduced once, resumed inside a window (the checkpoint then refused on one
    # process); FSDP2's refusal of the option is drawn by the long run (`ranks_config`), not here (a launch of its own)
    "bf16_wide_fabric_ddp_two_ranks_resumed": {
        **_WIDE, "adapter": "fabric", "world": 2, "epochs": 2, "n": 32, "seed": 12, "passes": 2, "last_arg": True,
        "interruptions": [["save", 0, 1]], "schedule": {"family": "constant", "k": 3}},
    # SWA under bf16: Lightning averages in a copy of the module made before the precision converted it
    "bf16_wide_swa_budget": {
        **_WIDE, "count": True, "batch_size": 3, "epochs": 3, "lr_scaling": "linear", "n": 27, "optimizer": "momentum",
        "schedule": {"family": "budget", "max_k": None, "n": 18, "unit": "items"}, "seed": 631, "swa": [0.05, 1],
        "scheduler": {"interval": "epoch", "kind": "step", "step_size": 1}},
}  # fmt: skip


def case(name: str) -> Config:
    return Config(**CASES[name])
