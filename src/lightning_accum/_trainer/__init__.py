"""The Trainer adapters' machinery: the callback's and the mixin's drivers, blocks, guards, schedulers,
pieces, recovery and the window reports they publish.
"""
