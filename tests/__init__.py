"""Ballast test suite."""
