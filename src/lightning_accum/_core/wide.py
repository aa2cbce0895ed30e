"""``grad_accum_dtype``: a window's gradient summed in a wider dtype than its parameters' own.

Under ``bf16-true`` (or ``16-true``) a parameter's ``.grad`` is bf16, so the k micro-batch gradients of a
window would be summed in bf16, rounded at every add: the error grows with k. ``WideSums`` moves each
narrow trainable parameter's ``.grad`` into a slice of one flat float32 buffer as soon as autograd has
accumulated it (``Tensor.register_post_accumulate_grad_hook``) and frees the bf16 gradient at once, so
between micro-batches a narrow parameter holds 4 bytes of sum instead of 2 of gradient. At the window's
end the sum is normalised in float32 and rounded to the parameter's dtype once (``land``), where the
optimizer, clipping and every hook see it. Parameters as wide as the dtype are not touched.

Plain torch, no Lightning: the engine drives it (``WindowEngine.widen``), the adapters only attach it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Container, Iterable, Iterator, Sequence

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from lightning_accum._core.errors import NonFiniteWindowError

#: what ``grad_accum_dtype`` accepts as a string (a LightningCLI config), and the dtype each names
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
}


#: which ``WideSums`` takes (or weighs) each parameter's gradient now: an ``attach`` takes a parameter over from an
#: earlier owner (whose hook on it is removed), so that a gradient goes into one sum only (a ``FabricAccumulator``
#: keeps its hooks as long as it lives: a second one on the model must not find each gradient taken already). Both
#: held weakly.
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def check_grad_accum_dtype(value: object) -> torch.dtype | None:
    """``grad_accum_dtype`` as a dtype (``None``: the gradients are summed in ``.grad``, in the parameters' dtype),
    or an error naming the argument and what it takes.

    Example:

        >>> check_grad_accum_dtype("fp32"), check_grad_accum_dtype(torch.float32), check_grad_accum_dtype(None)
        (torch.float32, torch.float32, None)
    """
    if value is None:
        return None
    if isinstance(value, str):
        dtype = DTYPE_NAMES.get(value.strip().lower().removeprefix("torch."))
        if dtype is None:
            raise ValueError(
                f"`grad_accum_dtype` must be torch.float32 (or 'float32' / 'fp32'), torch.float64, or None; got "
                f"{value!r}. Under bf16 or fp16 parameters, 'float32' sums each window's gradient in float32 and "
                "rounds it to the parameters' dtype once."
            )
        return dtype
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"`grad_accum_dtype` must be a torch dtype (torch.float32) or its name ('float32'), or None; got "
            f"{type(value).__name__} {value!r}."
        )
    if value not in (torch.float32, torch.float64):
        what = "not a floating dtype" if not value.is_floating_point or value.is_complex else "no wider than bf16/fp16"
        raise ValueError(
            f"`grad_accum_dtype={value}` is {what}: the window's gradient is summed in this dtype, so it must be "
            "torch.float32 (or torch.float64). Give torch.float32, or None to sum in the parameters' own dtype."
        )
    return value


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """A dtype as a checkpoint keeps it (``"float32"``), ``None`` for ``None``."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def narrow(params: Iterable[Tensor], dtype: torch.dtype, kept: Container[int] = ()) -> list[Tensor]:
    """The trainable floating parameters narrower than ``dtype`` (each once), and those of ``kept`` (ids) frozen for
    now; a parameter wider than it is refused: its gradient summed in ``dtype`` would lose what its own dtype keeps."""
    chosen: dict[int, Tensor] = {}
    for p in params:
        if not (p.requires_grad or id(p) in kept) or not p.is_floating_point():
            continue
        width = torch.finfo(p.dtype).bits
        if width > torch.finfo(dtype).bits:
            raise ValueError(
                f"`grad_accum_dtype={dtype}` is narrower than a trained parameter of dtype {p.dtype} (shape "
                f"{tuple(p.shape)}): its window's gradient would be summed with less precision than `.grad` keeps. "
                f"Give `grad_accum_dtype={p.dtype}`, or None."
            )
        if width < torch.finfo(dtype).bits:
            chosen.setdefault(id(p), p)
    return list(chosen.values())


class WideSums:
    """The wide sums of a window's narrow parameters: one flat buffer per device, a slice (``view``) each.

    Args:
        dtype: what the sums are kept in (``torch.float32``).

    Example:

        >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> sums = WideSums(torch.float32)
        >>> sums.attach([w])
        >>> for _ in range(3):
        ...     (w * 0.1).sum().backward()
        >>> w.grad is None, sums.views[0].tolist()  # the bf16 gradient freed; the sum kept in float32
        (True, [0.30029296875, 0.30029296875])
        >>> _ = sums.land(1 / 3); w.grad.dtype, w.grad.tolist()  # normalised in float32, rounded to bf16 once
        (torch.bfloat16, [0.10009765625, 0.10009765625])
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.params: list[Tensor] = []
        self.views: list[Tensor] = []  # each parameter's sum, a slice of its device's flat buffer
        self.flats: list[Tensor] = []  # the flat buffers (one per device): what a collective reduces
        self.filled: list[bool] = []  # whether a gradient reached the sum since it was last landed or cleared
        #: whether the sum holds the window's normalised gradient (`land`), till the next window's first gradient
        self.landed: list[bool] = []
        self._index: dict[int, int] = {}
        #: by the parameter's id: whether its gradient is taken into a sum (else weighed), and the hook. A hook
        #: outlives `requires_grad_(False)`, which `toggle_optimizer` sets for a while on another optimizer's parameters
        self._hooks: dict[int, tuple[bool, RemovableHandle]] = {}
        #: what the backward passes under way are weighted by (`weighting`): each gradient as it is taken
        self.weight: float | Tensor = 1.0
        self._moved: dict[torch.device, Tensor] = {}  # a tensor weight on each other device it was needed on

    @property
    def active(self) -> bool:
        """Whether any parameter's sums are kept here (none: every trained parameter is as wide as the dtype)."""
        return bool(self.params)

    def holds(self, p: Tensor) -> bool:
        return id(p) in self._index

    def attach(self, params: Iterable[Tensor]) -> None:
        """Keep the sums of ``params``' narrow trainable ones from now on, and of those attached before and frozen
        for now (``toggle_optimizer`` freezes another optimizer's parameters between its passes): sums still held
        from before are kept, for a checkpoint; a ``.grad`` that exists now stays where it is, for the adapter's
        zeroing. A parameter another ``WideSums`` takes (or weighs) the gradient of is taken over from it."""
        params = list(params)
        chosen = narrow(params, self.dtype, self._hooks)
        if [id(p) for p in chosen] != [id(p) for p in self.params]:
            self._allocate(chosen)
        # the other trained parameters (as wide as the dtype) take `weighting`'s weight on their own
        taken = {id(p) for p in chosen}
        weighed = {id(p): p for p in params if id(p) not in taken and p.is_floating_point() and (
            p.requires_grad or id(p) in self._hooks)} if chosen else {}  # fmt: skip
        for key, (takes, handle) in list(self._hooks.items()):
            if key not in (taken if takes else weighed):
                del self._hooks[key]
                handle.remove()
        for p in chosen:
            if id(p) not in self._hooks:
                self._own(p)
                self._hooks[id(p)] = (True, p.register_post_accumulate_grad_hook(self._take_hook))  # type: ignore[no-untyped-call]
        for p in weighed.values():
            if id(p) not in self._hooks:
                self._own(p)
                self._hooks[id(p)] = (False, p.register_hook(self._weigh))  # type: ignore[no-untyped-call]

    def _own(self, p: Tensor) -> None:
        """``p``'s gradient is this one's to take (or weigh) from now on: taken over from an earlier owner."""
        owner = _OWNERS.get(p)  # type: ignore[no-untyped-call]
        previous = None if owner is None else owner()
        if previous is not None and previous is not self:
            previous._give_up(p)
        _OWNERS[p] = weakref.ref(self)

    def _give_up(self, p: Tensor) -> None:
        """Take (or weigh) no more of ``p``'s gradient: another ``WideSums`` took it over."""
        hook = self._hooks.pop(id(p), None)
        if hook is not None:
            hook[1].remove()

    def stale(self, params: Iterable[Tensor]) -> bool:
        """Whether ``params``' narrow trainable ones (and those attached, frozen for now) are no longer those
        attached (a param group was added or a parameter unfrozen since): ``attach`` them again where no sum is
        held."""
        return [id(p) for p in narrow(params, self.dtype, self._hooks)] != [id(p) for p in self.params]

    def joining(self, params: Iterable[Tensor]) -> list[Tensor] | None:
        """``params``' narrow trainable ones not attached yet (a param group added, a parameter unfrozen); ``None``
        where an attached one is no longer among them (its param group removed)."""
        chosen = narrow(params, self.dtype, self._hooks)
        kept = {id(p) for p in chosen}
        if any(id(p) not in kept for p in self.params):
            return None
        return [p for p in chosen if id(p) not in self._index]

    def _allocate(self, params: list[Tensor]) -> None:
        held = {id(p): self.views[i] for i, p in enumerate(self.params) if self.filled[i]}  # (kept: copied over)
        by_device: dict[torch.device, list[int]] = {}
        for i, p in enumerate(params):
            by_device.setdefault(p.device, []).append(i)
        self.params, self.views, self.flats = params, [torch.empty(0)] * len(params), []
        self.filled, self.landed = [False] * len(params), [False] * len(params)
        self._index = {id(p): i for i, p in enumerate(params)}
        for device, indices in by_device.items():
            flat = torch.zeros(sum(params[i].numel() for i in indices), dtype=self.dtype, device=device)
            self.flats.append(flat)
            offset = 0
            for i in indices:
                n = params[i].numel()
                self.views[i] = flat[offset : offset + n].view(params[i].shape)
                offset += n
        for i, p in enumerate(params):  # (a window under way that a param group joins keeps what it holds)
            if id(p) in held:
                self.views[i].copy_(held[id(p)])
                self.filled[i] = True

    def _take_hook(self, p: Tensor) -> None:
        self._take(self._index[id(p)], p)

    def _take(self, i: int, p: Tensor) -> None:
        """``p.grad`` (times the pass's weight, in the wide dtype) into its sum, and freed."""
        grad, view = p.grad, self.views[i]
        if grad is None:
            return
        weight = self._weight_on(view.device)
        if not self.filled[i]:
            view.copy_(grad)
            self.filled[i], self.landed[i] = True, False
            if _weighted(weight):
                view.mul_(weight)
        elif not _weighted(weight):
            _add(view, grad)
        elif isinstance(weight, Tensor):
            view.addcmul_(grad, weight)
        else:
            view.add_(grad, alpha=weight)
        p.grad = None

    def _weigh(self, grad: Tensor) -> Tensor:
        """A wide parameter's gradient, before it is accumulated: times the pass's weight, in its own dtype."""
        weight = self._weight_on(grad.device)
        return (grad * weight).to(grad.dtype) if _weighted(weight) else grad

    def _weight_on(self, device: torch.device) -> float | Tensor:
        """The pass's weight, a tensor one on ``device`` (moved once per `weighting`)."""
        weight = self.weight
        if not isinstance(weight, Tensor) or weight.device == device:
            return weight
        if device not in self._moved:
            self._moved[device] = weight.to(device)
        return self._moved[device]

    @contextlib.contextmanager
    def weighting(self, weight: float | Tensor) -> Iterator[None]:
        """Inside: the backward passes' gradients are weighted by ``weight`` (a number or a 0-d tensor, e.g. a
        mean loss's item count) as they are taken: a narrow parameter's multiplied in the wide dtype as it goes into
        its sum, any other's in its own dtype before it is accumulated. The passes themselves run unweighted, so the
        weight adds no rounding in the narrow dtype, as it would on the loss (``loss * n``).

        Example:

            >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> sums = WideSums(torch.float32)
            >>> sums.attach([w])
            >>> with sums.weighting(3):
            ...     (w * 0.1).sum().backward()
            >>> sums.views[0].tolist()  # bf16's 0.1 times 3, in float32 (bf16 would round it to 0.30078125)
            [0.30029296875, 0.30029296875]
        """
        previous, self.weight, self._moved = self.weight, weight, {}
        try:
            yield
        finally:
            self.weight, self._moved = previous, {}

    def detach(self) -> None:
        """Stop taking gradients (the sums are kept: a checkpoint written after a failure still saves them)."""
        for _, handle in self._hooks.values():
            handle.remove()
        self._hooks = {}

    # ------------------------------------------------------------------ the window
    def _chosen(self, params: Iterable[Tensor] | None) -> list[int]:
        if params is None:
            return list(range(len(self.params)))
        return [i for i in (self._index.get(id(p)) for p in params) if i is not None]

    def sums(self, params: Iterable[Tensor] | None = None) -> list[Tensor]:
        """The sums that hold a gradient (of ``params``' narrow ones; all for ``None``)."""
        return [self.views[i] for i in self._chosen(params) if self.filled[i]]

    def slot(self, p: Tensor) -> Tensor:
        """``p``'s sum, zeroed first if no gradient reached it (a collective must reduce it on every rank)."""
        i = self._index[id(p)]
        if not self.filled[i]:
            self.views[i].zero_()
            self.filled[i], self.landed[i] = True, False
        return self.views[i]

    def slot_of(self, p: Tensor) -> Tensor:
        """The tensor that holds ``p``'s window gradient, made (zeros) where it has none: its sum if it is narrow,
        ``.grad`` otherwise (what a collective reduces, ``collectives.all_reduce_gradients``)."""
        if id(p) in self._index:
            return self.slot(p)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    def land(self, scale: float, params: Iterable[Tensor] | None = None) -> list[Tensor]:
        """The window's end: each sum that holds a gradient multiplied by ``scale`` in the wide dtype and rounded
        to its parameter's dtype once, into ``.grad`` (of ``params``' narrow ones; all for ``None``); returns those
        gradients. A float16 gradient whose finite sum overflows float16 is refused (``NonFiniteWindowError``)."""
        chosen = [i for i in self._chosen(params) if self.filled[i]]
        if not chosen:
            return []
        views = [self.views[i] for i in chosen]
        if scale != 1.0:
            torch._foreach_mul_(views, scale)
        landed = []
        for i, view in zip(chosen, views, strict=True):
            p = self.params[i]
            p.grad = view.to(p.dtype)
            landed.append(p.grad)
            self.filled[i], self.landed[i] = False, True
        _refuse_overflow([(g, v) for g, v in zip(landed, views, strict=True) if g.dtype == torch.float16])
        return landed

    def clear(self, params: Iterable[Tensor] | None = None) -> None:
        """Forget the sums (of ``params``' narrow ones; all for ``None``): the window was left out or not stepped."""
        for i in self._chosen(params):
            self.filled[i] = self.landed[i] = False

    def normalised(self, p: Tensor) -> Tensor | None:
        """``p``'s window gradient as ``land`` normalised it, in the wide dtype (``None``: not landed, or ``p`` is not
        narrow): what a ``GradientDecay`` combines with its residual before rounding once."""
        i = self._index.get(id(p))
        return None if i is None or not self.landed[i] else self.views[i]

    # ------------------------------------------------------------------ checkpoints
    def current(self, params: Sequence[Tensor]) -> list[Tensor | None]:
        """Each parameter's window gradient so far, as a checkpoint saves it: the wide sum of a narrow one (``None``
        if nothing reached it), ``.grad`` of any other."""
        out: list[Tensor | None] = []
        for p in params:
            i = self._index.get(id(p))
            out.append(p.grad if i is None else self.views[i] if self.filled[i] else None)
        return out

    def restore(self, params: Sequence[Tensor], saved: Sequence[Tensor | None]) -> list[Tensor]:
        """Put a checkpoint's partial sums of the narrow ``params`` back (exactly: the sums as saved); returns the
        parameters it did not take (wide ones), whose gradients go to ``.grad`` as before."""
        rest = []
        for p, g in zip(params, saved, strict=True):
            i = self._index.get(id(p))
            if i is None:
                rest.append(p)
            elif g is None:
                self.filled[i] = self.landed[i] = False
            else:
                self.views[i].copy_(g.to(self.views[i].device))
                self.filled[i], self.landed[i] = True, False
        return rest

    def dtype_of(self, p: Tensor) -> torch.dtype:
        """The dtype ``p``'s window gradient is kept in."""
        return self.dtype if id(p) in self._index else p.dtype


def _weighted(weight: float | Tensor) -> bool:
    """Whether a pass's weight is other than 1 (a tensor always counts as one: it is not read on the host)."""
    return isinstance(weight, Tensor) or weight != 1.0


#: a CPU gradient with more elements than this is added into its sum in pieces of this many (``_add``)
_CPU_PIECE = 1 << 18


def _add(total: Tensor, grad: Tensor) -> None:
    """``total += grad`` (a wide sum and a narrow gradient), the same sums bit for bit. On the CPU torch converts the
    narrow operand of a mixed-dtype add into a wide copy of the whole tensor first (CUDA converts as it reads): fresh
    pages of 4 bytes an element, most of the add's time for a large gradient (2.5x a bf16 ``.grad += g`` for GPT-2's
    embedding), so a large CPU gradient is added a piece at a time, each piece's copy small and reused."""
    large = grad.device.type == "cpu" and grad.numel() > _CPU_PIECE and grad.layout == torch.strided
    if not (large and grad.is_contiguous() and total.is_contiguous()):
        total.add_(grad)
        return
    pieces = torch.split(grad.view(-1), _CPU_PIECE)
    for into, piece in zip(torch.split(total.view(-1), _CPU_PIECE), pieces, strict=True):
        into.add_(piece)


def _refuse_overflow(pairs: Sequence[tuple[Tensor, Tensor]]) -> None:
    """A float16 gradient (of ``pairs``: gradient, sum) that rounded to infinity from a finite sum: refused (one
    host read, under float16 parameters only)."""
    if not pairs:
        return
    over = torch.stack([(g.isinf() & v.isfinite()).any() for g, v in pairs]).any()
    if bool(over):
        raise NonFiniteWindowError(
            "The window's gradient, summed in the wide `grad_accum_dtype`, is finite but exceeds float16's range "
            "(65504) once rounded to the parameters' float16 for the step, so it was refused as a non-finite window "
            "is. Lower the loss scale (e.g. a mean rather than a sum), use bf16 parameters (`precision='bf16-true'`), "
            "or float32 ones with `precision='16-mixed'`."
        )


#: why each sharded or self-accumulating strategy family cannot take ``grad_accum_dtype``, and what does the job there
_ELSEWHERE = {
    "deepspeed": (
        "DeepSpeed sums a window's gradient in its own buffers, in the dtype its config names: set "
        '`"data_types": {"grad_accum_dtype": "fp32"}` in `DeepSpeedStrategy(config=...)` and leave '
        "`grad_accum_dtype=None` here."
    ),
    "fsdp2": (
        "FSDP2 holds a window's unsharded gradients itself while its sync is skipped. Over float32 sharded "
        "parameters with `fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
        "reduce_dtype=torch.float32))` it sums them in float32 (torch's "
        "`FSDPParam.to_accumulated_grad_if_needed`), reduce-scatters in float32 and never rounds the gradient to "
        "bf16: use that, with `grad_accum_dtype=None`. Over bf16 sharded parameters it rounds the reduced sum to "
        "bf16 before the window is normalised, the second rounding this option avoids."
    ),
    "fsdp": (
        "FSDP (1) holds a window's unsharded gradient in its flat parameters, summed by autograd in the compute dtype "
        "under `no_sync()`. With float32 parameters, `MixedPrecision(param_dtype=torch.bfloat16, "
        "reduce_dtype=torch.float32)` and `sync='every'`, it sums each micro-batch's reduce-scattered gradient into a "
        "float32 shard: use that with `grad_accum_dtype=None`, or FSDP2."
    ),
}


def refuse_under(family: str, dtype: torch.dtype | None, who: str) -> None:
    """Refuse ``grad_accum_dtype`` under a strategy family whose gradient the package does not hold (DeepSpeed,
    FSDP, FSDP2), naming what does the job there."""
    if dtype is None or family not in _ELSEWHERE:
        return
    raise ValueError(f"{who}: `grad_accum_dtype={dtype_name(dtype)!r}` cannot work here. {_ELSEWHERE[family]}")


def inert_note(dtype: torch.dtype) -> str:
    """What is warned, once, when no trained parameter is narrower than ``grad_accum_dtype`` (e.g. ``bf16-mixed``,
    whose parameters are float32): the option changes nothing."""
    return (
        f"`grad_accum_dtype={dtype_name(dtype)!r}` changes nothing in this fit: no trained parameter is narrower than "
        f"{dtype_name(dtype)} (under `precision='bf16-mixed'` or `'16-mixed'` the parameters and their gradients are "
        "float32 already). The windows are summed in `.grad` as without it."
    )
