"""The float64 reference of the gradient-noise measurements behind ``NoiseScale`` and ``lr_scaling="adascale"``,
written from ``docs/guide/adaptive.md`` ("What a window measures, exactly"; the numbers below are its items), not
from the package's code. Plain torch: it imports neither Lightning nor ``lightning_accum``.

The reference loop (``reference.py``) asks it for each window's ``k`` at the window's open, for AdaScale's gain at
the window's close, and hands it each stepped window's micro-batches (per rank) and whole gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .configs import Config
from .model import micro_loss

ADASCALE_BETA = 0.995  # (6) the helper's own estimates, where the schedule is no `NoiseScale`


def prefix_positions(microbatches: int) -> list[int]:
    """(2) After which of a rank's micro-batches the probe takes a prefix: 1, 4, 16, ..., not the last."""
    out, i = [], 1
    while i < microbatches:
        out.append(i)
        i *= 4
    return out


def fit(prefixes: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(3) ``(|G|^2, tr(Sigma))`` from the prefixes ``(B_i, S_i)`` of one rank: the increments from ``B_0 = S_0 = 0``
    regressed by least squares weighted ``1 / (B_i^2 - B_{i-1}^2)``; a prefix no larger than the last kept one is
    left out (2); ``None`` with fewer than two sizes."""
    rows: list[list[float]] = []
    rhs: list[float] = []
    b0 = s0 = 0.0
    for b, s in prefixes:
        if not b > b0:
            continue
        root = 1.0 / math.sqrt(b * b - b0 * b0)  # (the square root of the weight)
        rows.append([(b * b - b0 * b0) * root, (b - b0) * root])
        rhs.append((s - s0) * root)
        b0, s0 = b, s
    if len(rows) < 2:
        return None
    a, y = torch.tensor(rows, dtype=torch.float64), torch.tensor(rhs, dtype=torch.float64)
    solution = torch.linalg.lstsq(a, y[:, None], driver="gelsd").solution[:, 0]
    return float(solution[0]), float(solution[1])


class NoiseReference:
    """One fit's (and a refit's: it goes on) noise estimates, ``k`` and AdaScale's base batch."""

    def __init__(self, c: Config) -> None:
        self.spec = c.schedule if c.schedule.get("family") == "noise" else None
        self.adascale = c.lr_scaling == "adascale"
        self.items, self.count = c.normalize == "items", c.count
        self.beta = float(self.spec.get("beta", 0.995)) if self.spec is not None else ADASCALE_BETA
        # (4) decayed sums over measuring windows: m_w, m_w |G|^2, m_w tr(Sigma), m_w u_w; and how many measured
        self.sums = [0.0, 0.0, 0.0, 0.0]
        self.measured = 0
        spec = self.spec or {}
        self.k_now = int(spec.get("start") or spec.get("min_k", 1))  # (5) `start`, or `min_k`
        self.changed_at = 0
        self.first_units: float | None = None  # (6) B_0

    @property
    def active(self) -> bool:
        return self.spec is not None or self.adascale

    def _avg(self, i: int) -> float:
        return self.sums[i] / self.sums[0]

    def noise_scale(self) -> float | None:
        """(4) ``B_simple``, or ``None`` while ``avg |G|^2 <= 0`` (or before any measurement)."""
        if not self.measured or self._avg(1) <= 0:
            return None
        return max(self._avg(2), 0.0) / self._avg(1)

    def k(self, step: int) -> int:
        """(5) The window opening at ``step`` optimizer steps."""
        spec = self.spec
        assert spec is not None
        b = self.noise_scale()
        ready = self.measured >= spec.get("warmup", 5) and step - self.changed_at >= spec.get("every", 10)
        if ready and b is not None and self._avg(3) > 0:
            k, ratio = self.k_now, float(spec.get("max_ratio", 2.0))
            low = max(spec["min_k"], min(math.ceil(k / ratio), k - 1))
            high = min(spec["max_k"], max(math.floor(k * ratio), k + 1))
            target = min(max(round(b / self._avg(3)), low), high)
            if abs(target - k) > spec.get("hysteresis", 0.05) * k:
                self.k_now, self.changed_at = target, step
        return self.k_now

    def gain(self, units: float) -> float:
        """(6) AdaScale's gain for a window of ``units`` (over all ranks) stepped now, before its own measurement;
        the first one asked is the first window stepped (``B_0``)."""
        if self.first_units is None:
            self.first_units = units
        if not self.measured:
            return 1.0
        trace, grad_sq = max(self._avg(2), 0.0), max(self._avg(1), 0.0)
        if trace + grad_sq == 0:
            return 1.0
        return (trace / self.first_units + grad_sq) / (trace / units + grad_sq)

    def measure(
        self,
        net: nn.Module,
        window: list[dict[str, Tensor]],
        world: int,
        guide: nn.Module | None = None,
        piece: int | None = None,
    ) -> None:
        """(2)-(4) One stepped window: ``window`` its micro-batches (rank r's are ``window[r::world]``), the net's
        ``.grad`` its whole normalised gradient over all ranks (before decay, clipping and the step); ``piece``:
        the net run on slices of that many samples, as the package cuts them (``model.forward``)."""
        params = [prm for prm in net.parameters() if prm.requires_grad]  # (a frozen layer is in no optimizer)
        whole = sum(float((prm.grad.double() ** 2).sum()) for prm in params if prm.grad is not None)
        units = [self._units(b) for b in window]
        total = sum(units)
        fits = []
        for r in range(world):
            mine = window[r::world]
            prefixes = []
            for i in prefix_positions(len(mine)):
                losses = [micro_loss(net, b, guide, piece) for b in mine[:i]]
                if self.items:  # the sum of the losses over the prefix's items
                    loss = sum((t for t, _, _ in losses), torch.zeros((), dtype=torch.float64))
                else:  # the sum of the micro-batches' mean losses, times the prefix's mean samples per micro-batch
                    loss = sum((t / positions for t, _, positions in losses), torch.zeros((), dtype=torch.float64))
                b_i = sum(units[r::world][:i])
                grads = torch.autograd.grad(loss, params, allow_unused=True) if loss.requires_grad else []
                s_i = sum(float((g**2).sum()) for g in grads if g is not None)
                prefixes.append((b_i, s_i if self.items else s_i * (b_i / i) ** 2))
            if not prefixes:
                return  # (3) a rank that took no prefix before the last: the window measures nothing
            fitted = fit([*prefixes, (total, whole * total**2)])
            if fitted is None:
                return
            fits.append(fitted)
        grad_sq = sum(f[0] for f in fits) / world
        trace = sum(f[1] for f in fits) / world
        m = len(window)
        u = total / (m / world)
        b = self.beta
        self.sums = [b * s + m * x for s, x in zip(self.sums, (1.0, grad_sq, trace, u), strict=True)]
        self.measured += 1

    def _units(self, batch: dict[str, Tensor]) -> float:
        """(1) Samples (``"mean"``) or items (``"items"``: the fuzzer's ``count``, its tokens)."""
        return float(batch["mask"].sum()) if self.items and self.count else float(len(batch["x"]))
