"""Kernel grader: correctness gate x speedup against an expert implementation, measured by the grader."""
