"""Code grader: hidden tests by a pristine runner in a judging fork (see grader.py)."""
