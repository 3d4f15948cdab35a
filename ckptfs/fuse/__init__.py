"""The FUSE glue: pyfuse3 operations that call the model and turn its errors into errno (ops),
and who opened each writer, so that a forked child's close does not commit it (openers)."""
