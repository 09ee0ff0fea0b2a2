"""Unit tests: pure logic, no network."""
