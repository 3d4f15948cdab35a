"""The `ckptfs` command: the parser (main), one module per command group (mount, control,
catalog, verify) and what they share (common). Runs in the user's process, not the daemon."""
