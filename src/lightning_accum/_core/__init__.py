"""The window engine and its maths: windows, their counts and divisors, the collectives, gradient
operations, sync plans, checkpoints of a window, gradient decay, the cached backward. Imports no
Trainer adapter.
"""
