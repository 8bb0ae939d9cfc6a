"""Loading plugins: the built-ins and third-party ones, all through the `kinfer_rpc` entry points.

`KINFER_RPC_PLUGINS` (comma-separated entry-point names) restricts which load; unset loads all.
A plugin that fails to import, to register, or that registers something malformed is recorded
in `Plugins.broken` and skipped: it never stops the server.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os

import attrs
import pluggy

from . import hookspecs

log = logging.getLogger(__name__)
GROUP = "kinfer_rpc"


@attrs.define
class Plugins:
    """Everything the plugins registered, by kind and name."""

    backends: dict = attrs.field(factory=dict)
    draft_policies: dict = attrs.field(factory=dict)
    placements: dict = attrs.field(factory=dict)
    loaded: list = attrs.field(factory=list)  # [{name, version}]
    broken: list = attrs.field(factory=list)  # [{name, error}]

    def capabilities(self) -> dict:
        return {
            "backends": sorted(self.backends),
            "draftPolicies": sorted(self.draft_policies),
            "placements": sorted(self.placements),
            "plugins": list(self.loaded),
            "brokenPlugins": list(self.broken),
        }


_REQUIRED = {
    "backends": ("name", "formats", "load"),
    "draft_policies": ("name", "propose"),
    "placements": ("name", "plan"),
}


def _wanted() -> set[str] | None:
    value = os.environ.get("KINFER_RPC_PLUGINS")
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def load_plugins(entry_points=None) -> Plugins:
    """Import every wanted entry point, register it with pluggy, and collect what it registers."""
    pm = pluggy.PluginManager(GROUP)
    pm.add_hookspecs(hookspecs)
    plugins = Plugins()
    wanted = _wanted()
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=GROUP)
    owners = {}
    for ep in entry_points:
        if wanted is not None and ep.name not in wanted:
            continue
        try:
            module = ep.load()
            pm.register(module, name=ep.name)
        except Exception as exc:  # a broken third-party plugin must not stop the server
            plugins.broken.append({"name": ep.name, "error": f"{type(exc).__name__}: {exc}"})
            log.error("plugin %s failed to load: %s", ep.name, exc)
            continue
        version = ep.dist.version if getattr(ep, "dist", None) else None
        owners[ep.name] = {"name": ep.name, "version": version}

    for kind in ("backends", "draft_policies", "placements"):
        hook = getattr(pm.hook, f"register_{kind}")
        table = getattr(plugins, kind)
        for impl in hook.get_hookimpls():
            def register(obj, _kind=kind, _table=table, _plugin=impl.plugin_name):
                missing = [a for a in _REQUIRED[_kind] if not hasattr(obj, a)]
                if missing:
                    raise TypeError(f"{_kind[:-1]} {obj!r} lacks {', '.join(missing)}")
                if obj.name in _table:
                    raise ValueError(f"{_kind[:-1]} {obj.name!r} is registered twice")
                _table[obj.name] = obj

            try:
                impl.function(register=register)
            except Exception as exc:
                plugins.broken.append(
                    {"name": impl.plugin_name, "error": f"register_{kind}: {type(exc).__name__}: {exc}"}
                )
                log.error("plugin %s failed in register_%s: %s", impl.plugin_name, kind, exc)
                owners.pop(impl.plugin_name, None)
    broken_names = {b["name"] for b in plugins.broken}
    plugins.loaded = [info for name, info in owners.items() if name not in broken_names]
    return plugins
