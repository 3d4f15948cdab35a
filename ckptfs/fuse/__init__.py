"""The FUSE glue: the transport's handlers, which call the model and turn its errors into errno
(ops); who opened each writer, so that a forked child's close does not commit it (openers); the
kernel's node ids and its passthrough rules (nodeids)."""
