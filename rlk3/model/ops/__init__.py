"""Kernels: torch references (CPU path and ground truth) beside the GPU paths, one dispatch point per op."""
