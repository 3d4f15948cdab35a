"""Admin work on a store URL or a mount, shared by the CLI and the daemon: the checkpoint
catalog and its series (ls, checkpoints, gc), DCP metadata, command targets, verify."""
