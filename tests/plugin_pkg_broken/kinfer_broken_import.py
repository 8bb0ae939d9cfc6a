"""A plugin that cannot even be imported: the server must skip it, say why, and keep serving."""

raise RuntimeError("kinfer_broken_import is broken on purpose")
