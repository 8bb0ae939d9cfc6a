"""A plugin that imports but fails while registering: the server must skip it and say why."""

import kinfer_rpc


@kinfer_rpc.hookimpl
def register_placements(register):
    raise RuntimeError("kinfer_broken_register fails to register on purpose")
