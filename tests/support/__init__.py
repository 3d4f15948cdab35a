"""Test helpers that are not tests: harness, mounts, the in-process namespace, fault injection, Swift."""
