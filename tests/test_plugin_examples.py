"""docs/plugins.md's worked example, docs/examples/kinfer_markov, installed and run for real.

The package is installed with pip into a temporary folder exactly as tests/test_plugins.py installs
its example (`pip_install`, tests/plugin_helpers.py), and a spawned `kinfer-rpc` with that folder on
PYTHONPATH finds it through its entry point. Through the protocol: the server lists the backend, the draft policy and
the placement; the backend loads a corpus and generates the corpus's greedy bigram chain; drafts
never change a reply; the placement places the embedded GGUF model on the llama backend, and a
markov load refuses it (placements apply only to GGUF models on backends that report their
machine: Runtime.place). In process, through the installed entry point: load_plugins registers
one of each kind, and the policy and the placement (with a machine made up for it) do what they
say. Last, docs/plugins.md's code must be excerpts of this package and this file.
"""

from __future__ import annotations

import collections
import importlib.metadata
import json
import re
import sys
from pathlib import Path

import pytest
from paths import ROOT
from plugin_helpers import pip_install
from rpcclient import DEFAULT_MODEL, RpcClient, error_of

from kinfer_rpc.host.plugins import load_plugins
from kinfer_rpc.types import LoadOptions, MachineInfo, ModelFacts, PlacementPlan

PACKAGE = ROOT / "docs" / "examples" / "kinfer_markov"
CORPUS = (
    b"the cat sat on the mat. the dog sat on the log. a cat and a dog met on the mat;\n"
    b"then the cat ran to the den and the dog ran to the pond, and that was the end of that.\n"
)
EOG = 256


def greedy_chain(corpus: bytes, last: int, n: int) -> bytes:
    """Up to n bytes, each the most common follower of the one before (ties: the lowest byte);
    the corpus's end counts as the end of generation after its last byte."""
    follows = collections.defaultdict(collections.Counter)
    for a, b in zip(corpus, corpus[1:]):
        follows[a][b] += 1
    follows[corpus[-1]][EOG] += 1
    out = []
    for _ in range(n):
        seen = follows.get(last)
        if not seen:
            break
        last = min(seen, key=lambda b: (-seen[b], b))
        if last == EOG:
            break
        out.append(last)
    return bytes(out)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return pip_install(PACKAGE, tmp_path_factory.mktemp("markov"))


@pytest.fixture(scope="module")
def server(site):
    env = {"PYTHONPATH": str(site), "KINFER_RPC_PLUGINS": "llama,markov"}
    with RpcClient.spawn(env=env) as client:
        client.capabilities = client.initialize()["capabilities"]
        yield client
        client.assert_clean()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "tiny-markov"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "markov"}))
    (folder / "corpus.txt").write_bytes(CORPUS)
    return folder


def test_initialize_lists_the_installed_example(server):
    caps = server.capabilities
    assert "markov" in caps["backends"] and "llama" in caps["backends"]
    assert "markov-repeat" in caps["draftPolicies"]
    assert "markov-cpu" in caps["placements"]
    assert {"name": "markov", "version": "0.1.0"} in caps["plugins"]
    assert caps["brokenPlugins"] == []


def test_the_markov_backend_generates_the_corpus_greedy_chain(server, model_dir):
    loaded = server.call("model/load", {"model": str(model_dir), "backend": "markov", "options": {"slots": 2}})
    assert loaded["backend"] == "markov" and loaded["drafts"] == 4 and loaded["placement"] is None
    params = {"model": str(model_dir), "prompt": "the dog sat on the l", "options": {"temperature": 0, "maxTokens": 48}}
    first = server.call("inference/generate", params)
    expected = greedy_chain(CORPUS, ord("l"), 48)  # b"og the the the ..."
    assert len(expected) == 48, "the corpus's chain must not end early, or the test checks little"
    assert first["text"].encode() == expected and first["tokens"] == list(expected)
    assert first["stopReason"] == "length"
    assert server.call("inference/generate", params)["text"] == first["text"]

    # The same request drafting with markov-repeat: more tokens a pass, never another reply.
    drafted = server.call(
        "inference/generate", {**params, "options": {**params["options"], "draftPolicy": "markov-repeat"}}
    )
    assert drafted["text"] == first["text"]
    assert drafted["usage"]["draftTokens"] > 0 and drafted["usage"]["draftAccepted"] > 0, drafted["usage"]

    # Sampled: every byte follows the one before somewhere in the corpus.
    sampled = server.call(
        "inference/generate", {**params, "options": {"temperature": 1.0, "seed": 7, "maxTokens": 64, "topK": 0}}
    )
    pairs = {CORPUS[i : i + 2] for i in range(len(CORPUS) - 1)}
    text = b"l" + sampled["text"].encode()
    assert all(text[i : i + 2] in pairs for i in range(len(text) - 1)), text

    # inference/chat renders the example's template: the message's text and a newline.
    chat = server.call(
        "inference/chat",
        {
            "model": str(model_dir),
            "messages": [{"role": "user", "content": "a cat"}],
            "options": {"temperature": 0, "maxTokens": 32},
        },
    )
    assert chat["text"].encode() == greedy_chain(CORPUS, ord("\n"), 32)
    assert chat["usage"]["promptTokens"] == len(b"a cat\n")


def test_placements_do_not_apply_to_a_markov_load(server, model_dir, tmp_path):
    other = tmp_path / "other-markov"
    other.mkdir()
    for name in ("config.json", "corpus.txt"):
        (other / name).write_bytes((model_dir / name).read_bytes())
    response = server.request(
        "model/load", {"model": str(other), "backend": "markov", "options": {"placement": "markov-cpu"}}
    )
    error = error_of(response)
    assert error["code"] == -31006 and "places mlx models itself" in error["message"]


@pytest.mark.model
def test_the_placement_places_a_gguf_model_on_llama(server):
    """The embedded SmolLM2-135M GGUF on the built-in llama backend: the placement decides."""
    loaded = server.load_model(DEFAULT_MODEL, placement="markov-cpu")
    assert loaded["backend"] == "llama" and loaded["placement"] == "markov-cpu"
    assert loaded["gpuLayers"] == 0 and loaded["placementReason"].startswith("markov-cpu: all 30 layers in host memory")


def test_the_markov_backend_refuses_another_folder_with_the_reason(server, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    error = error_of(server.request("model/load", {"model": str(tmp_path), "backend": "markov"}))
    assert error["code"] == -31003 and "model_type 'llama', not 'markov'" in error["message"]


@pytest.fixture
def installed(site, monkeypatch):
    """The installed package's entry points, loadable in this process; forgotten afterwards."""
    monkeypatch.delenv("KINFER_RPC_PLUGINS", raising=False)
    monkeypatch.syspath_prepend(str(site))
    (dist,) = importlib.metadata.distributions(path=[str(site)])
    yield list(dist.entry_points.select(group="kinfer_rpc"))
    sys.modules.pop("kinfer_markov", None)


def test_load_plugins_registers_one_of_each_kind(installed):
    plugins = load_plugins(installed)
    assert plugins.broken == [] and plugins.loaded == [{"name": "markov", "version": "0.1.0"}]
    caps = plugins.capabilities()
    assert caps["backends"] == ["markov"] and caps["draftPolicies"] == ["markov-repeat"]
    assert caps["placements"] == ["markov-cpu"]


def test_the_draft_policy_repeats_what_followed_the_last_token(installed):
    propose = installed[0].load().RepeatDraft().propose
    history = list(b"abcab")
    assert propose(history, 3) == list(b"cab") and propose(history, 1) == list(b"c")
    assert propose(history, 0) == [] and propose(list(b"abc"), 2) == [] and propose([], 2) == []
    assert history == list(b"abcab"), "a policy must not change the history it is given"


def test_the_placement_keeps_every_layer_on_the_host_or_says_what_fits(installed):
    cpu = installed[0].load().CpuOnly()
    facts = ModelFacts(path="/models/small.gguf", size_bytes=1000, layers=30, kv_bytes_per_cell=2)
    options = LoadOptions(context_length=100, slots=2)
    plan = cpu.plan(facts, MachineInfo(has_gpu=True, gpu_free_bytes=10**12, host_free_bytes=10**6), options)
    assert isinstance(plan, PlacementPlan)
    assert plan.gpu_layers == 0 and plan.host_tensors == () and "all 30 layers" in plan.reason
    assert cpu.plan(facts, MachineInfo(), options).gpu_layers == 0, "unknown free memory refuses nothing"
    with pytest.raises(ValueError, match="small.gguf needs 1000 bytes .* but 1200 are free.* under 800 bytes"):
        cpu.plan(facts, MachineInfo(host_free_bytes=1200), options)


def test_the_docs_code_is_the_example_as_it_is():
    """docs/plugins.md's Python blocks are excerpts of the example or of this file (a `# ...` line
    marks a cut), and its pyproject.toml block is the package's own."""
    doc = (ROOT / "docs" / "plugins.md").read_text()
    sources = [(PACKAGE / "kinfer_markov.py").read_text(), Path(__file__).read_text()]
    blocks = re.findall(r"^```python\n(.*?)^```", doc, re.S | re.M)
    assert len(blocks) >= 8, "the worked examples went missing from docs/plugins.md"
    for block in blocks:
        for piece in re.split(r"^ *# \.\.\..*\n", block, flags=re.M):
            piece = piece.strip("\n")
            assert not piece or any(piece in source for source in sources), f"not in the example:\n{piece}"
    (toml,) = re.findall(r"^```toml\n(.*?)^```", doc, re.S | re.M)
    assert toml == (PACKAGE / "pyproject.toml").read_text()
