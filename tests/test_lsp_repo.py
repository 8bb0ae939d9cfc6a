"""The repository as context, on files of this repository, through pygls's LanguageClient: a
completion in a new file that uses a definition from another open file (kinfer_rpc/protocol/
text.py's `utf16_len`) sends that definition to `inference/infill`, with no plugin and no
`openFiles`.

With the fake infill (tests/lsp_helpers.py) the test reads what the server asked for; with the
FIM test model (SmolLM2-135M with FIM tokens, not trained to fill in the middle) it counts the
prompt's tokens: the chunk is in the prompt. Whether the model then writes `utf16_len` is up to
the model; the test says what it wrote.
"""

from __future__ import annotations

import asyncio
import sys

import pytest
from lsprotocol import types as t
from paths import ROOT
from pygls_helpers import completion, did_change, did_open, edit, session

TEXT_PY = ROOT / "kinfer_rpc" / "protocol" / "text.py"
TEXT_URI = TEXT_PY.as_uri()
NEW_URI = (ROOT / "kinfer_rpc" / "protocol" / "scratch_width.py").as_uri()
NEW = '"""Widths of labels."""\n\nfrom kinfer_rpc.protocol import text\n\n\ndef width(label):\n    return text.\n'
DEFINITION = "def utf16_len(text: str) -> int:"


def test_a_definition_from_another_open_file_reaches_the_prompt(tmp_path):
    source = TEXT_PY.read_text()
    assert DEFINITION in "\n".join(source.splitlines()[:64])  # in the chunk a didOpen takes

    async def body(client, log, result):
        did_open(client, source, uri=TEXT_URI)
        did_open(client, NEW, uri=NEW_URI)
        got = await completion(client, 6, 16, uri=NEW_URI)
        assert got.items
        from lsp_helpers import events

        (start,) = [e for e in events(log) if e["event"] == "start"]
        extra = start["extra"]
        assert [e["filename"] for e in extra] == [str(TEXT_PY)]
        assert DEFINITION in extra[0]["text"] and extra[0]["text"].count("\n") == 64
        assert start["prefix"].endswith("    return text.")

    session(tmp_path, body)


@pytest.mark.model
def test_with_a_fim_model_the_chunk_is_read_with_the_prompt(tmp_path, fim):
    cmd = [sys.executable, "-m", "kinfer_rpc"]
    init = {
        "completion": {
            "model": fim,
            "loadOptions": {"contextLength": 4096, "slots": 1},
            "maxTokens": 12,
            "ring": {"warmMs": 200},
        }
    }
    source = TEXT_PY.read_text()
    seen: dict[str, object] = {}

    async def body(client, log, result):
        did_open(client, source, uri=TEXT_URI)
        did_open(client, NEW, uri=NEW_URI)
        # idle: the server reads the chunk into the prefix pool by itself
        stats: dict = {}
        for _ in range(300):
            await asyncio.sleep(0.1)
            stats = await client.workspace_execute_command_async(t.ExecuteCommandParams(command="kinfer.stats"))
            if stats["warms"]:
                break
        assert stats["warms"] == 1
        with_ring = await completion(client, 6, 16, uri=NEW_URI)
        (item,) = with_ring.items or [None]
        seen["text"] = item.text_edit.new_text if item else ""
        usage = item.data["usage"][0] if item else {}
        # the same request without the ring: the prompt is the document alone
        client.workspace_did_change_configuration(
            t.DidChangeConfigurationParams(settings={"completion": {**init["completion"], "ring": False}})
        )
        await asyncio.sleep(0.1)
        without = await completion(client, 6, 16, uri=NEW_URI)
        (bare,) = without.items or [None]
        bare_usage = bare.data["usage"][0] if bare else {}
        seen.update(ring=usage, bare=bare_usage, bare_text=bare.text_edit.new_text if bare else "")
        print("with the ring:", seen["text"], usage, "| without:", seen["bare_text"], bare_usage)
        # the 64 lines of text.py are in the first prompt: hundreds of tokens more, read ahead
        assert usage["promptTokens"] - bare_usage["promptTokens"] > 300
        assert usage["cachedTokens"] > usage["promptTokens"] - bare_usage["promptTokens"]
        # n alternatives: the prompt is read once, the others find it in the prefix pool
        client.workspace_did_change_configuration(
            t.DidChangeConfigurationParams(settings={"completion": {**init["completion"], "ring": False, "n": 3}})
        )
        await asyncio.sleep(0.1)
        did_change(client, 2, edit(6, 16, 6, 16, "u"), uri=NEW_URI)
        several = await completion(client, 6, 17, uri=NEW_URI)
        assert several.items
        usages = several.items[0].data["usage"]
        print("n=3:", [i.text_edit.new_text for i in several.items], usages)
        assert len(usages) == 3
        assert all(u["cachedTokens"] >= u["promptTokens"] - 1 for u in usages[1:])

    env = {k: v for k, v in __import__("os").environ.items() if k != "KINFER_RPC_PLUGINS"}
    session(tmp_path, body, init_options=init, cmd=cmd, env=env)
