"""Shared attention math and kernels: masks, SDPA wrappers, the distance kernel, Triton, backend choice."""
