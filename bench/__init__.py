"""Ballast benchmarks: programs that print a table and write bench/results/<name>.json."""
