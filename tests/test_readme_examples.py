"""The README's examples, run as they are written.

Every ```python block runs with this interpreter; the "Clients" section's ```js block runs with
`node` (importing `kinfer-rpc-client` as an installed package would), its ```lua block in a
headless Neovim, and the ```sh blocks (the README's first five minutes, docs/cli.md's commands)
with bash, with this virtualenv's bin first on PATH, as the README's set-up leaves it.

An example that needs a model other than the embedded one says the `kinfer pull NAME` it needs
first, in the text before it: the test runs that line, against a registry on 127.0.0.1 that
serves stand-ins under the names the README pulls (the embedded model's weights with a chat
template that takes tools, tests/modelgen/make_tool_model.py, or with fill-in-the-middle tokens
for a coder model, tests/modelgen/make_fim_model.py), then the example as written.
An example that names $KINFER_EMBED_MODEL and $KINFER_RERANK_MODEL (the "Embeddings" section) runs
on all-MiniLM-L6-v2 and its reranker copy (tests/modelgen/make_embedding_model.py).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from readme_helpers import CLI_DOC, NODE_CLIENT, README, ROOT, blocks, pulls_before

BIN = os.path.dirname(sys.executable)


def env() -> dict:
    e = dict(os.environ)
    e["PATH"] = BIN + os.pathsep + e.get("PATH", "")
    e["KINFER_RPC"] = os.path.join(BIN, "kinfer-rpc")
    # llama.cpp's OpenMP workers spin while they wait; on a shared, busy CPU that costs 10x.
    e.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return e


def test_each_client_has_an_example():
    assert blocks("python", "Clients") and blocks("js", "Clients") and blocks("lua", "Clients")
    assert blocks("sh", "The first five minutes") and blocks("sh", doc=CLI_DOC)


def test_the_set_up_is_two_commands_that_leave_kinfer_on_path():
    """Two commands for a fresh machine: the main job on the embedded model, and the tests (which
    .ci/run follows). Each activates the virtualenv, so `kinfer` is on PATH afterwards."""
    text = README.read_text()
    section = text[text.index("\n## Set up\n") : text.index("\n## ", text.index("\n## Set up\n") + 1)]
    commands = [line.strip() for line in section.splitlines() if line.startswith("    ")]
    assert len(commands) == 2, commands
    run, test = commands
    for command in commands:
        assert command.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install "), command
    assert run.endswith('kinfer chat "Why is the sky blue? Answer in two sentences."')
    assert "'.[test]'" in test and test.endswith("bash patches/build_llama.sh && make check")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -e '.[test" in ci and "bash patches/build_llama.sh" in ci and "make lint typecheck" in ci


def example_env(registry, tmp_path) -> dict:
    """This virtualenv's, with stores of its own and the stand-in registry."""
    e = env()
    e.update(
        KINFER_REGISTRY=registry.url,
        KINFER_MODELS=str(tmp_path / "models"),
        OLLAMA_MODELS=str(tmp_path / "ollama"),
        KINFER_HOME=str(tmp_path / "home"),
    )
    return e


def kinfer_pull(name: str, e: dict, cwd: Path) -> None:
    proc = subprocess.run(
        ["bash", "-c", f"kinfer pull {name}"], env=e, capture_output=True, text=True, timeout=120, cwd=cwd
    )
    assert proc.returncode == 0, f"kinfer pull {name}:\n{proc.stderr}"


@pytest.fixture(scope="module")
def embedding_models(tmp_path_factory) -> dict[str, str]:
    import make_embedding_model as models

    if models.missing():
        pytest.skip(models.missing() or "")
    rerank = models.make_copy(tmp_path_factory.mktemp("rerank") / "minilm-rerank.gguf", "rerank")
    return {"KINFER_EMBED_MODEL": models.minilm_gguf(), "KINFER_RERANK_MODEL": rerank}


@pytest.mark.model
@pytest.mark.parametrize("code", blocks("python"), ids=lambda c: c.strip().splitlines()[0][:40])
def test_python_example(code, tmp_path, registry, request):
    script = tmp_path / "example.py"
    script.write_text(code)
    e = example_env(registry, tmp_path)
    for name in pulls_before(code):  # what the README says to pull first, then the example as written
        assert name in code
        kinfer_pull(name, e, tmp_path)
    if "KINFER_EMBED_MODEL" in code:
        e.update(request.getfixturevalue("embedding_models"))
    proc = subprocess.run(
        [sys.executable, str(script)],
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.stdout.strip()


@pytest.mark.model
def test_the_first_five_minutes(tmp_path, registry):
    (code,) = blocks("sh", "The first five minutes")
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        env=example_env(registry, tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "pulled qwen3:0.6b" in proc.stdout and "qwen3:0.6b" in proc.stdout.split("NAME", 1)[1]
    assert "eval rate:" in proc.stderr and "prompt eval count:" in proc.stderr  # --verbose
    assert "WARNING" not in proc.stderr  # llama.cpp's warnings stay out


@pytest.mark.model
def test_cli_examples(tmp_path):
    (code,) = blocks("sh", doc=CLI_DOC)
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "\x1b[" not in proc.stdout  # no colours when not on a terminal
    assert "['llama', 'mlx']" in proc.stdout  # kinfer doctor --json: the backends
    assert "tok/s" in proc.stdout


def test_the_config_example_is_a_config_kinfer_reads(tmp_path):
    from kinfer_rpc.terminal import config

    (text,) = blocks("toml", doc=CLI_DOC)
    (tmp_path / "config.toml").write_text(text)
    cfg = config.read(tmp_path / "config.toml")
    assert cfg.model == "qwen3:0.6b" and cfg.options["maxTokens"] == 512


NPM_OFFLINE = ("ENOTFOUND", "EAI_AGAIN", "ETIMEDOUT", "ECONNREFUSED", "ECONNRESET", "ENETUNREACH")


def node_install_command() -> str:
    """The README's command that installs the Node client, for this checkout."""
    text = README.read_text()
    section = text[text.index("\n### Node (") : text.index("\n### Neovim")]
    (command,) = re.findall(r"`(npm install [^`]*)`", section)
    return command


@pytest.fixture(scope="module")
def node_client(tmp_path_factory) -> tuple[str, Path]:
    """node, and a fresh folder where the Node client is installed as the README says."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node/npm are not installed")
    # kinfer-rpc as a fresh clone has it: clients/node without a node_modules of its own.
    clone = tmp_path_factory.mktemp("clone") / "kinfer-rpc"
    shutil.copytree(NODE_CLIENT, clone / "clients" / "node", ignore=shutil.ignore_patterns("node_modules"))
    app = tmp_path_factory.mktemp("node-app")
    command = node_install_command().replace("/path/to/kinfer-rpc", str(clone))
    proc = subprocess.run(
        [*shlex.split(command), "--no-audit", "--no-fund"], cwd=app, capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0 and any(code in proc.stderr for code in NPM_OFFLINE):
        pytest.skip(f"npm cannot reach its registry: {proc.stderr[-500:]}")
    assert proc.returncode == 0, f"{command}:\n{proc.stderr}"
    return node, app


def test_the_node_client_installs_as_the_readme_says(node_client):
    # The line a person types, in a fresh folder: the client, its dependency and a tiny script.
    node, app = node_client
    assert node_install_command() in (NODE_CLIENT / "README.md").read_text()  # both READMEs say it
    (app / "tiny.mjs").write_text(
        "import { KinferClient } from 'kinfer-rpc-client';\n"
        "const kinfer = await KinferClient.start();\n"
        "const models = await kinfer.models();\n"
        "console.log(kinfer.serverInfo.serverInfo.name, models.some((m) => m.source === 'embedded'));\n"
        "console.log('exit code', await kinfer.close());\n"
    )
    proc = subprocess.run(
        [node, "tiny.mjs"], env=env(), capture_output=True, text=True, timeout=120, cwd=app, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.stdout.splitlines() == ["kinfer-rpc true", "exit code 0"]
    installed = app / "node_modules" / "kinfer-rpc-client"
    assert installed.is_dir() and not installed.is_symlink()  # a copy: the clone may move


@pytest.mark.model
def test_node_example(node_client):
    (code,) = blocks("js", "Clients")
    node, app = node_client  # the client installed as the README says
    (app / "example.mjs").write_text(code)
    proc = subprocess.run(
        [node, "example.mjs"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=app,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "cancelled: -32800" in proc.stdout
    assert "exit code 0" in proc.stdout


NVIM_EPILOGUE = r"""
vim.wait(60000, function() return done end, 20)
vim.fn.writefile(vim.api.nvim_buf_get_lines(buf, 0, -1, false), vim.env.KINFER_TEST_OUT .. '/buffer.txt')
local code
client:stop(function(c) code = c end)
vim.wait(20000, function() return code ~= nil end, 20)
vim.fn.writefile({ tostring(code) }, vim.env.KINFER_TEST_OUT .. '/exit.txt')
vim.cmd('qa!')
"""


@pytest.mark.model
def test_nvim_example(tmp_path):
    nvim = shutil.which("nvim")
    if nvim is None:
        pytest.skip("Neovim is not installed (apt-get install neovim): the nvim example is untested here")
    (code,) = blocks("lua", "Clients")
    script = tmp_path / "example.lua"
    script.write_text(code + NVIM_EPILOGUE)
    proc = subprocess.run(
        [
            nvim,
            "--headless",
            "-u",
            "NONE",
            "-i",
            "NONE",
            "-n",
            "--cmd",
            f"set runtimepath^={ROOT / 'clients' / 'nvim'}",
            "-c",
            f"luafile {script}",
        ],
        env={**env(), "KINFER_TEST_OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert (tmp_path / "exit.txt").exists(), f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert (tmp_path / "exit.txt").read_text().strip() == "0"
    assert "".join((tmp_path / "buffer.txt").read_text().split()), "nothing was streamed into the buffer"
    assert "tokens" in proc.stdout + proc.stderr  # the example's on_done printed


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readmes_links_reach_its_sections_and_files():
    text = README.read_text()
    anchors = {anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    for target in re.findall(r"\]\(#([^)]+)\)", text):
        assert target in anchors, target
    for target in re.findall(r"\]\(((?:docs|spec|patches|clients)/[^)#]+)", text):
        assert (ROOT / target).exists(), target
