"""Everything in --cache-dir and the RAM tier: the arenas and their slots (arena), byte budgets,
eviction and backpressure (cache), a file's cached blocks (contents), the journal of committed
but not yet durable operations, and the index of clean blocks kept across mounts."""
