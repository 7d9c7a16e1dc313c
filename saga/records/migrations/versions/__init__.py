"""One module per revision of the records schema, oldest first (0001, 0002, ...)."""
