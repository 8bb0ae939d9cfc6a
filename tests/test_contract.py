"""The plugin contract, checked once: when a plugin registers, and when a backend's model loads.

A required member missing, an optional capability present only in part, or a public attribute
that looks like a misspelling of a member the object lacks is a clear error naming it: a misspelt
optional member would otherwise turn a feature off with no word said.
"""

from __future__ import annotations

import pytest

import kinfer_rpc
from kinfer_rpc.engine.scheduler import Engine
from kinfer_rpc.host.plugins import load_plugins
from kinfer_rpc.types import CONTRACTS, contract_problems, members


class Backend:
    name = "fake"
    formats = ("gguf",)

    def load(self, path, options, progress):
        raise NotImplementedError


class Misspelt(Backend):
    def machin(self):  # MachineAware's machine()
        raise NotImplementedError


class Policy:
    name = "fake-policy"

    def propose(self, history, k):
        return []


class Entry:
    """An entry point whose plugin registers `backend` and `policy`."""

    dist = None

    def __init__(self, name, backend=None, policy=None):
        self.name, self._backend, self._policy = name, backend, policy

    def load(self):
        backend, policy = self._backend, self._policy

        class Plugin:
            @staticmethod
            @kinfer_rpc.hookimpl
            def register_backends(register):
                if backend is not None:
                    register(backend)

            @staticmethod
            @kinfer_rpc.hookimpl
            def register_draft_policies(register):
                if policy is not None:
                    register(policy)

        return Plugin


def test_every_built_in_plugin_object_keeps_the_contract(monkeypatch):
    monkeypatch.delenv("KINFER_RPC_PLUGINS", raising=False)
    plugins = load_plugins()
    assert plugins.broken == []
    for kind, objects in (
        ("backend", plugins.backends),
        ("draft policy", plugins.draft_policies),
        ("placement", plugins.placements),
    ):
        assert objects
        for obj in objects.values():
            assert contract_problems(obj, kind) == [], obj


def test_a_missing_member_a_partial_capability_and_a_misspelling_are_named():
    assert contract_problems(Backend(), "backend") == []
    assert contract_problems(Misspelt(), "backend") == ["has 'machin', not 'machine': misspelt?"]

    class NoLoad:
        name, formats = "x", ("gguf",)

    assert contract_problems(NoLoad(), "backend") == ["lacks load"]

    class HalfGreedy:  # DeviceGreedy needs set_device_greedy and sampled_tokens too
        device_greedy = True

    problems = contract_problems(HalfGreedy(), "model")
    assert any("device_greedy but not sampled_tokens, set_device_greedy" in p for p in problems), problems
    # Every optional capability is a documented, runtime-checkable protocol.
    for required, optional in CONTRACTS.values():
        assert members(required)
        for capability in optional:
            assert capability.__doc__ and members(capability)
            assert getattr(capability, "_is_runtime_protocol", False)


def test_a_draft_policy_drafts_one_way_exactly():
    """`propose` (from one history) or `session` (state per load), never both, never neither."""

    class Both(Policy):
        def session(self, target, backend, options):
            raise AssertionError

    class Neither:
        name = "neither"

    class Session:
        name = "session"

        def session(self, target, backend, options):
            raise AssertionError

    assert contract_problems(Policy(), "draft policy") == []
    assert contract_problems(Session(), "draft policy") == []
    for wrong, count in ((Both(), 2), (Neither(), 0)):
        (problem,) = contract_problems(wrong, "draft policy")
        assert problem == f"needs exactly one of propose (Proposes) or session (SessionPolicy), has {count}", problem
    plugins = load_plugins([Entry("both", policy=Both())])
    assert plugins.draft_policies == {} and "needs exactly one of" in plugins.broken[0]["error"]


def test_registering_a_misspelt_plugin_object_skips_that_plugin_with_the_reason():
    plugins = load_plugins([Entry("good", policy=Policy()), Entry("typo", backend=Misspelt())])
    assert [p["name"] for p in plugins.loaded] == ["good"]
    assert plugins.backends == {}
    (broken,) = plugins.broken
    assert broken["name"] == "typo" and "'machin', not 'machine'" in broken["error"]


def test_a_loaded_model_that_breaks_the_contract_fails_its_load_with_the_reason():
    closed = []

    class Model:  # a backend written from wrong docs: is_eog instead of eog_tokens()
        def tokenize(self, text, add_special, parse_special):
            return []

        def is_eog(self, token):
            return False

        def close(self):
            closed.append(True)

    engine = Engine(lambda progress: Model(), lambda f: f())
    with pytest.raises(TypeError, match="lacks .*eog_tokens"):
        engine.load_model()
    assert closed == [True] and engine.model is None
