"""The package's own exceptions (the adapters raise them; ``lightning_accum`` re-exports them)."""

from __future__ import annotations


class NonFiniteWindowError(RuntimeError, FloatingPointError):
    """A window whose gradient is NaN or infinite was refused rather than stepped (the window is left out and
    the next one starts clean).

    ``FabricAccumulator(gradient_clip_val=...)`` raises it where ``fabric.clip_gradients`` (its
    ``error_if_nonfinite=True`` default) raises a ``RuntimeError``, so code written against Fabric
    (``except RuntimeError``) catches it. It is also a ``FloatingPointError``, what the package raised before,
    so ``except FloatingPointError`` keeps working.

    Example:

        >>> from lightning_accum import NonFiniteWindowError
        >>> issubclass(NonFiniteWindowError, RuntimeError), issubclass(NonFiniteWindowError, FloatingPointError)
        (True, True)
    """
