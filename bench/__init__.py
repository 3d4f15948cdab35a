"""scripts/bench: ckptfs side by side with the tools users would use instead (docs/benchmarks.md)."""
