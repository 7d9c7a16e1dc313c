"""A trip booking whose two undos are broken on purpose, for ``saga drill`` to catch."""
