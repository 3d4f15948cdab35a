"""The mount's process: the wiring of its parts (wiring), the run loop with FUSE, signals and
shutdown (run), the admin commands' answers (commands), metrics, logs, resource limits and the
mount path checks."""
