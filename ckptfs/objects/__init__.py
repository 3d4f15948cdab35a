"""What ckptfs writes under a key: the compressed (zstd seekable) format, the checksum manifests
and their checks (integrity), and the store as a mount reads it, sizes uncompressed."""
