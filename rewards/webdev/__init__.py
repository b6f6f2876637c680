"""Webdev grader: grader-owned build + headless Chromium e2e with random data."""
