"""Kernels: pure-torch references (CPU path and oracle) and fast GPU versions tested against them."""
