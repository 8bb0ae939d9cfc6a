"""Plugins: real packages installed with pip and seen by a real server, and load_plugins in process.

tests/plugin_pkg is an out-of-tree plugin package (docs/plugins.md's worked example);
tests/plugin_pkg_broken holds two plugins that are broken on purpose. Each is installed with pip
into a temporary folder that the spawned `kinfer-rpc` gets on its PYTHONPATH, so the plugin is
found through its entry point exactly as an installed third-party plugin is.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from plugin_helpers import pip_install

import kinfer_rpc
from kinfer_rpc.host.plugins import load_plugins
from kinfer_rpc.types import LoadOptions, MachineInfo, ModelFacts, PlacementPlan

HERE = Path(__file__).parent
EXAMPLE_PKG = HERE / "plugin_pkg"
BROKEN_PKG = HERE / "plugin_pkg_broken"
KINFER_RPC = os.path.join(os.path.dirname(sys.executable), "kinfer-rpc")
TIMEOUT = 60.0


# -- installing a plugin package (plugin_helpers.pip_install) -----------------------------------
@pytest.fixture(scope="module")
def example_site(tmp_path_factory):
    return pip_install(EXAMPLE_PKG, tmp_path_factory.mktemp("example"))


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory):
    return pip_install(BROKEN_PKG, tmp_path_factory.mktemp("broken"))


# -- talking to a spawned server ----------------------------------------------------------------
class Spawned:
    """A `kinfer-rpc` process: write frames to its stdin, read frames from its stdout."""

    def __init__(self, sites=(), plugins: str | None = None):
        env = dict(os.environ)
        env.pop("KINFER_RPC_PLUGINS", None)
        if plugins is not None:
            env["KINFER_RPC_PLUGINS"] = plugins
        env["PYTHONPATH"] = os.pathsep.join([*map(str, sites), *filter(None, [env.get("PYTHONPATH")])])
        self.proc = subprocess.Popen(
            [KINFER_RPC], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        self.frames: queue.Queue = queue.Queue()
        self.notifications: list[dict] = []
        self.stderr = bytearray()
        self._ids = iter(range(1, 1 << 30))
        threading.Thread(target=self._read_frames, daemon=True).start()
        threading.Thread(target=self._drain_stderr, daemon=True).start()

    def _read_frames(self) -> None:
        out = self.proc.stdout
        while True:
            length = None
            while True:
                line = out.readline()
                if not line:
                    self.frames.put(None)
                    return
                if line == b"\r\n":
                    break
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            self.frames.put(json.loads(out.read(length)))

    def _drain_stderr(self) -> None:
        # A server whose stderr pipe fills up blocks: keep it empty.
        for chunk in iter(lambda: self.proc.stderr.read1(65536), b""):
            self.stderr += chunk

    def send(self, message: dict) -> None:
        body = json.dumps(message).encode()
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.proc.stdin.flush()

    def receive(self, timeout: float = TIMEOUT) -> dict:
        try:
            frame = self.frames.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"no frame within {timeout}s; stderr:\n{self.stderr.decode(errors='replace')}"
            ) from None
        assert frame is not None, f"the server closed stdout; stderr:\n{self.stderr.decode(errors='replace')}"
        return frame

    def request(self, method: str, params=None, timeout: float = TIMEOUT) -> dict:
        """Send a request; return its response, keeping the notifications that came first."""
        rid = next(self._ids)
        self.send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params or {}})
        while True:
            message = self.receive(timeout)
            if message.get("id") == rid and "method" not in message:
                return message
            self.notifications.append(message)

    def initialize(self) -> dict:
        response = self.request("initialize", {"processId": os.getpid(), "capabilities": {}})
        assert "result" in response, response
        self.send({"jsonrpc": "2.0", "method": "initialized", "params": {}})
        return response["result"]["capabilities"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request("shutdown", timeout=10)
                self.send({"jsonrpc": "2.0", "method": "exit"})
                self.proc.stdin.close()
                self.proc.wait(10)
            except (AssertionError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def spawn():
    started = []

    def start(**kwargs) -> Spawned:
        server = Spawned(**kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


# -- installed plugins seen by the server ----------------------------------------------------------
def test_installed_plugin_is_listed_in_capabilities(example_site, spawn):
    server = spawn(sites=[example_site])
    caps = server.initialize()
    assert "example-repeat" in caps["draftPolicies"]
    assert "example-cpu" in caps["placements"]
    assert "example-echo" in caps["backends"]
    assert "llama" in caps["backends"], "a third-party plugin must not displace the built-in one"
    assert {"name": "example", "version": "0.1.0"} in caps["plugins"]
    assert "llama" in [p["name"] for p in caps["plugins"]]
    assert caps["brokenPlugins"] == []
    # Its backend reads only the made-up "echo" format, so it is never taken for a GGUF model.
    refused = server.request("model/load", {"backend": "example-echo"})
    assert refused["error"]["code"] == -31005 and "cannot read gguf" in refused["error"]["message"]


@pytest.mark.model
def test_broken_plugins_are_reported_and_the_server_keeps_serving(example_site, broken_site, spawn):
    server = spawn(sites=[example_site, broken_site])
    caps = server.initialize()
    broken = {b["name"]: b["error"] for b in caps["brokenPlugins"]}
    assert set(broken) == {"broken_import", "broken_register"}
    assert "broken on purpose" in broken["broken_import"]
    assert "register_placements" in broken["broken_register"]
    assert "fails to register on purpose" in broken["broken_register"]
    names = [p["name"] for p in caps["plugins"]]
    assert "broken_import" not in names and "broken_register" not in names
    # The healthy plugins are untouched by their broken neighbours.
    assert "example" in names and "llama" in names
    assert "example-cpu" in caps["placements"]

    response = server.request("inference/tokenize", {"text": "hello"})
    assert response["result"]["tokens"], response
    logged = [
        n["params"] for n in server.notifications if n.get("method") == "window/logMessage" and n["params"]["type"] == 1
    ]
    for name in broken:
        assert any(name in entry["message"] for entry in logged), (name, logged)


def test_KINFER_RPC_PLUGINS_restricts_what_loads(example_site, broken_site, spawn):
    caps = spawn(sites=[example_site, broken_site], plugins="llama").initialize()
    assert [p["name"] for p in caps["plugins"]] == ["llama"]
    assert caps["backends"] == ["llama"]
    # The llama plugin's own draft policy (mtp needs llama.cpp's API) comes with it; nothing else.
    assert caps["draftPolicies"] == ["mtp"] and caps["placements"] == []
    # An unwanted plugin is not even imported, so a broken one cannot be reported either.
    assert caps["brokenPlugins"] == []


# -- load_plugins in process, with entry points we make ---------------------------------------------
class FakeDist:
    def __init__(self, version):
        self.version = version


class FakeEntryPoint:
    """What load_plugins uses of an importlib.metadata.EntryPoint: .name, .load(), .dist."""

    def __init__(self, name, plugin=None, *, error: Exception | None = None, version="1.0"):
        self.name = name
        self.plugin = plugin
        self.error = error
        self.dist = FakeDist(version)
        self.loads = 0

    def load(self):
        self.loads += 1
        if self.error is not None:
            raise self.error
        return self.plugin


@pytest.fixture
def example_module():
    """tests/plugin_pkg/kinfer_example imported in this process, and forgotten afterwards."""
    sys.path.insert(0, str(EXAMPLE_PKG))
    try:
        import kinfer_example

        yield kinfer_example
    finally:
        sys.path.remove(str(EXAMPLE_PKG))
        sys.modules.pop("kinfer_example", None)


@pytest.fixture
def no_plugin_filter(monkeypatch):
    monkeypatch.delenv("KINFER_RPC_PLUGINS", raising=False)


class DraftPlugin:
    """A plugin object (pluggy takes any object with hookimpls) registering draft policies."""

    def __init__(self, *policies):
        self.policies = policies

    @kinfer_rpc.hookimpl
    def register_draft_policies(self, register):
        for policy in self.policies:
            register(policy)


class Named:
    def __init__(self, name, **attributes):
        self.name = name
        self.__dict__.update(attributes)


def policy(name):
    return Named(name, propose=lambda history, k: [])


def test_load_plugins_registers_every_kind(example_module, no_plugin_filter):
    plugins = load_plugins([FakeEntryPoint("example", example_module, version="0.1.0")])
    assert plugins.broken == []
    assert plugins.loaded == [{"name": "example", "version": "0.1.0"}]
    caps = plugins.capabilities()
    assert caps["backends"] == ["example-echo"]
    assert caps["draftPolicies"] == ["example-repeat"]
    assert caps["placements"] == ["example-cpu"]
    json.dumps(caps)  # it goes into the initialize result as it is


def test_example_draft_policy_repeats_the_last_token(example_module):
    propose = example_module.RepeatDraft().propose
    assert propose([5, 7, 9], 3) == [9, 9, 9]
    assert propose([5, 7, 9], 0) == []
    assert propose([], 4) == []
    history = [1, 2, 3]
    assert propose(history, 2) == propose(list(history), 2), "depends only on the history"
    assert history == [1, 2, 3], "a policy must not change the history it is given"


def test_example_placement_keeps_everything_on_the_host(example_module):
    cpu = example_module.CpuOnly()
    model = ModelFacts(path="/models/tiny.gguf", size_bytes=100, layers=30)
    plan = cpu.plan(model, MachineInfo(has_gpu=True, gpu_free_bytes=10**9), LoadOptions())
    assert isinstance(plan, PlacementPlan)
    assert plan.gpu_layers == 0 and "30 layers" in plan.reason
    with pytest.raises(ValueError, match="free"):
        cpu.plan(model, MachineInfo(host_free_bytes=50), LoadOptions())


def test_example_backend_refuses_to_load_with_a_clear_message(example_module):
    echo = example_module.EchoBackend()
    assert echo.formats == ("echo",)
    with pytest.raises(NotImplementedError, match="example-echo cannot load"):
        echo.load("/models/x.echo", LoadOptions(), lambda fraction: None)


def test_a_name_registered_twice_marks_the_second_plugin_broken(no_plugin_filter):
    first = FakeEntryPoint("first", DraftPlugin(policy("same")))
    second = FakeEntryPoint("second", DraftPlugin(policy("same")))
    plugins = load_plugins([first, second])
    assert [p["name"] for p in plugins.loaded] == ["first"]
    assert [b["name"] for b in plugins.broken] == ["second"]
    assert "registered twice" in plugins.broken[0]["error"]
    assert list(plugins.draft_policies) == ["same"]


def test_a_malformed_registration_marks_the_plugin_broken(no_plugin_filter):
    plugins = load_plugins(
        [
            FakeEntryPoint("good", DraftPlugin(policy("fine"))),
            FakeEntryPoint("bad", DraftPlugin(Named("no-propose"))),
        ]
    )
    assert [b["name"] for b in plugins.broken] == ["bad"]
    assert "needs exactly one of propose (Proposes) or session" in plugins.broken[0]["error"]
    assert list(plugins.draft_policies) == ["fine"]
    assert [p["name"] for p in plugins.loaded] == ["good"]


def test_a_plugin_that_fails_to_import_is_reported(no_plugin_filter):
    plugins = load_plugins(
        [
            FakeEntryPoint("gone", error=ModuleNotFoundError("No module named 'kinfer_gone'")),
            FakeEntryPoint("fine", DraftPlugin(policy("fine"))),
        ]
    )
    assert plugins.broken == [{"name": "gone", "error": "ModuleNotFoundError: No module named 'kinfer_gone'"}]
    assert [p["name"] for p in plugins.loaded] == ["fine"]


def test_a_hookimpl_with_unknown_arguments_is_reported(no_plugin_filter):
    class WrongSignature:
        @kinfer_rpc.hookimpl
        def register_backends(self, register, engine):
            pass

    plugins = load_plugins([FakeEntryPoint("wrong", WrongSignature())])
    assert [b["name"] for b in plugins.broken] == ["wrong"]
    assert plugins.loaded == []


def test_KINFER_RPC_PLUGINS_skips_unwanted_entry_points_without_loading_them(monkeypatch):
    monkeypatch.setenv("KINFER_RPC_PLUGINS", " wanted , also ")
    wanted = FakeEntryPoint("wanted", DraftPlugin(policy("a")))
    also = FakeEntryPoint("also", DraftPlugin(policy("b")))
    unwanted = FakeEntryPoint("unwanted", error=RuntimeError("must not be imported"))
    plugins = load_plugins([wanted, unwanted, also])
    assert unwanted.loads == 0
    assert sorted(p["name"] for p in plugins.loaded) == ["also", "wanted"]
    assert plugins.broken == []


def test_a_plugin_that_fails_half_way_leaves_nothing_registered(no_plugin_filter):
    class HalfWay:
        @kinfer_rpc.hookimpl
        def register_draft_policies(self, register):
            register(policy("half-way"))

        @kinfer_rpc.hookimpl
        def register_placements(self, register):
            raise RuntimeError("fails after registering a policy")

    plugins = load_plugins([FakeEntryPoint("halfway", HalfWay())])
    assert [b["name"] for b in plugins.broken] == ["halfway"]
    assert "half-way" not in plugins.capabilities()["draftPolicies"]
