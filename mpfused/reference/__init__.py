"""Pure-PyTorch reference implementations: the oracle every kernel is tested against.

They compute in float64 and store in each tensor's own dtype; they are also the fallback
kernels registered for every device, so they run wherever torch runs (slowly)."""
