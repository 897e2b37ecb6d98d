"""phalanx's benchmark suite: side-by-side ratios against PyTorch DDP, raw gloo and a raw loop.

Run ``python -m benchmarks`` (or ``phalanx bench``) from the repository root.
"""
