"""The engines on PyTorch, behind :mod:`hift_runtime`'s bookkeeping: the compiled engine (:mod:`.compiled`, the step
under ``torch.compile`` and CUDA graphs) and the eager reference (:mod:`.eager`) the parity check (:mod:`.parity`)
compares against."""
