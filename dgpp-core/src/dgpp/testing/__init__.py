"""Test support for plugin authors: tiny random checkpoints in release layout, and conformance checks."""
