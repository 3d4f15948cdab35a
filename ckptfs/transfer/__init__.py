"""Bytes between the cache and the store: the uploader (streaming parts, ordered publish) with
its part sender, encoder and store calls, the fetcher (ranged reads, checks), retry policies."""
