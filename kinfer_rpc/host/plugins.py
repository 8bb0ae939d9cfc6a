"""Loading plugins: the built-ins (DEFAULT_PLUGINS) and third-party ones (the `kinfer_rpc` entry points).

Built-in plugins are ordinary plugins: registered by module path, through the same code path as an
entry point, so every test exercises what a third-party plugin goes through.
`KINFER_RPC_PLUGINS` (comma-separated plugin names) restricts which load; unset loads all.
A plugin that fails to import, to register, or that registers something malformed is recorded
in `Plugins.broken` and skipped: it never stops the server.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from collections.abc import Iterable
from typing import Any, Protocol

import attrs
import pluggy

from kinfer_rpc import __version__, hookspecs
from kinfer_rpc.types import Backend, BackendFeatures, DraftPolicy, Placement, contract_problems

log = logging.getLogger(__name__)
GROUP = "kinfer_rpc"
DEFAULT_PLUGINS = {  # name -> module
    "llama": "kinfer_rpc.default_plugins.llama",
    "drafts": "kinfer_rpc.default_plugins.drafts",
    "mlx": "kinfer_rpc.default_plugins.mlx",
    "placements": "kinfer_rpc.default_plugins.placements",
}


class Distribution(Protocol):
    """What load_plugins uses of an entry point's importlib.metadata.Distribution: .version."""

    @property
    def version(self) -> str: ...


class EntryPoint(Protocol):
    """What load_plugins uses of an importlib.metadata.EntryPoint: .name, .load(), .dist."""

    @property
    def name(self) -> str: ...

    @property
    def dist(self) -> Distribution | None: ...

    def load(self) -> Any: ...


@attrs.frozen
class BuiltinPlugin:
    """A built-in plugin, looked at as an entry point: .name, .load(), .dist."""

    name: str
    module: str
    dist = None

    def load(self) -> Any:
        return importlib.import_module(self.module)


def default_entry_points() -> list[EntryPoint]:
    """The built-ins, then every installed `kinfer_rpc` entry point."""
    return [BuiltinPlugin(name, module) for name, module in DEFAULT_PLUGINS.items()] + list(
        importlib.metadata.entry_points(group=GROUP)
    )


@attrs.define
class Plugins:
    """Everything the plugins registered, by kind and name."""

    backends: dict[str, Backend] = attrs.field(factory=dict)
    draft_policies: dict[str, DraftPolicy] = attrs.field(factory=dict)
    placements: dict[str, Placement] = attrs.field(factory=dict)
    loaded: list[dict[str, str | None]] = attrs.field(factory=list)  # [{name, version}]
    broken: list[dict[str, str]] = attrs.field(factory=list)  # [{name, error}]

    def capabilities(self) -> dict[str, Any]:
        return {
            "backends": sorted(self.backends),
            "draftPolicies": sorted(self.draft_policies),
            "placements": sorted(self.placements),
            "plugins": list(self.loaded),
            "brokenPlugins": list(self.broken),
            "backendFeatures": {name: _features(b) for name, b in sorted(self.backends.items())},
        }


def _features(backend: Any) -> dict[str, Any]:
    """A backend's features (BackendFeatures), {} without them or when asking fails."""
    if not isinstance(backend, BackendFeatures):
        return {}
    try:
        return dict(backend.features())
    except Exception:  # noqa: BLE001 - a third-party backend's bug costs its features only
        log.exception("backend %s: features() failed", getattr(backend, "name", backend))
        return {}


_NOUN = {"backends": "backend", "draft_policies": "draft policy", "placements": "placement"}


def _wanted() -> set[str] | None:
    value = os.environ.get("KINFER_RPC_PLUGINS")
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def load_plugins(entry_points: Iterable[EntryPoint] | None = None) -> Plugins:
    """Import every wanted entry point, register it with pluggy, and collect what it registers."""
    pm = pluggy.PluginManager(GROUP)
    pm.add_hookspecs(hookspecs)
    plugins = Plugins()
    wanted = _wanted()
    if entry_points is None:
        entry_points = default_entry_points()
    owners: dict[str, dict[str, str | None]] = {}
    for ep in entry_points:
        if wanted is not None and ep.name not in wanted:
            continue
        if ep.name in owners:
            plugins.broken.append({"name": ep.name, "error": "another installed plugin has the same entry-point name"})
            log.error("plugin %s: a second entry point of that name was skipped", ep.name)
            continue
        try:
            module = ep.load()
            pm.register(module, name=ep.name)
        except Exception as exc:  # a broken third-party plugin must not stop the server
            plugins.broken.append({"name": ep.name, "error": f"{type(exc).__name__}: {exc}"})
            log.error("plugin %s failed to load: %s", ep.name, exc)
            continue
        version = ep.dist.version if ep.dist is not None else __version__ if isinstance(ep, BuiltinPlugin) else None
        owners[ep.name] = {"name": ep.name, "version": version}

    # Collect each plugin's registrations apart, and keep them only if all of its hooks worked:
    # a plugin that fails halfway must not leave half of itself behind.
    staged: dict[str, dict[str, list[Backend | DraftPolicy | Placement]]] = {}
    failed: dict[str, str] = {}
    for kind in _NOUN:
        for impl in getattr(pm.hook, f"register_{kind}").get_hookimpls():
            name = impl.plugin_name
            if name in failed:
                continue
            found: list[Backend | DraftPolicy | Placement] = []

            def register(obj: Any, _kind: str = kind, _found: list[Backend | DraftPolicy | Placement] = found) -> None:
                problems = contract_problems(obj, _NOUN[_kind])
                if problems:
                    raise TypeError(f"{_NOUN[_kind]} {obj!r} {'; '.join(problems)}")
                _found.append(obj)

            try:
                impl.function(register=register)
            except Exception as exc:
                failed[name] = f"register_{kind}: {type(exc).__name__}: {exc}"
                continue
            staged.setdefault(name, {}).setdefault(kind, []).extend(found)
    for name, kinds in staged.items():
        if name in failed:
            continue
        clashes = [
            f"{_NOUN[kind]} {obj.name!r} is registered twice"
            for kind, objs in kinds.items()
            for obj in objs
            if obj.name in getattr(plugins, kind) or sum(o.name == obj.name for o in objs) > 1
        ]
        if clashes:
            failed[name] = "; ".join(clashes)
            continue
        for kind, objs in kinds.items():
            for obj in objs:
                getattr(plugins, kind)[obj.name] = obj
    for name, error in failed.items():
        plugins.broken.append({"name": name, "error": error})
        log.error("plugin %s was skipped: %s", name, error)
    plugins.loaded = [info for name, info in owners.items() if name not in failed]
    return plugins
