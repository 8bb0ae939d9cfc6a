"""pygls's LanguageClient driving `kinfer-rpc` as an editor would: a session, documents, completions."""

from __future__ import annotations

import asyncio
import os
import sys

from lsp_helpers import fake_server
from lsprotocol import types as t
from pygls.lsp.client import LanguageClient

TIMEOUT = 60.0


KINFER_RPC = os.path.join(os.path.dirname(sys.executable), "kinfer-rpc")


URI = "file:///work/project/app.py"


class Client(LanguageClient):
    def __init__(self):
        super().__init__("kinfer-lsp-test", "1")
        self.logs: list = []

        @self.feature(t.WINDOW_LOG_MESSAGE)
        def on_log(params):
            self.logs.append(params)

    async def server_exit(self, server):
        pass


def stock_initialize(init_options=None) -> t.InitializeParams:
    """What an editor's client sends: every InitializeParams member LSP has."""
    return t.InitializeParams(
        process_id=os.getpid(),
        client_info=t.ClientInfo(name="pygls-test", version="1"),
        locale="en-GB",
        root_path="/work/project",
        root_uri="file:///work/project",
        capabilities=t.ClientCapabilities(
            text_document=t.TextDocumentClientCapabilities(
                synchronization=t.TextDocumentSyncClientCapabilities(dynamic_registration=False),
                completion=t.CompletionClientCapabilities(),
                inline_completion=t.InlineCompletionClientCapabilities(),
            ),
            general=t.GeneralClientCapabilities(position_encodings=[t.PositionEncodingKind.Utf16]),
        ),
        initialization_options=init_options,
        trace=t.TraceValue.Off,
        workspace_folders=[t.WorkspaceFolder(uri="file:///work/project", name="project")],
        work_done_token="init-1",
    )


def session(tmp_path, body, delay=0.0, init_options=None, text=None, cmd=None, env=None):
    """A fake server (or `cmd`) under pygls's LanguageClient, initialized; runs `body(client, log)`."""
    log = tmp_path / "infill.jsonl"
    fake_cmd, fake_env = fake_server(log, delay, text)
    cmd, env = cmd or fake_cmd, env or fake_env

    async def main():
        client = Client()
        await client.start_io(*cmd, env=env)
        drain = asyncio.create_task(client._server.stderr.read())
        try:
            result = await asyncio.wait_for(client.initialize_async(stock_initialize(init_options)), TIMEOUT)
            client.initialized(t.InitializedParams())
            out = await asyncio.wait_for(body(client, log, result), TIMEOUT * 4)
            await asyncio.wait_for(client.shutdown_async(None), TIMEOUT)
            client.exit(None)
            return out
        finally:
            await asyncio.sleep(0.1)
            if client._server.returncode is None:
                client._server.kill()
            await client.stop()
            await drain

    return asyncio.run(main())


def did_open(client, text, uri=URI, language="python", version=1):
    client.text_document_did_open(
        t.DidOpenTextDocumentParams(t.TextDocumentItem(uri=uri, language_id=language, version=version, text=text))
    )


def did_change(client, version, *changes, uri=URI):
    client.text_document_did_change(
        t.DidChangeTextDocumentParams(
            text_document=t.VersionedTextDocumentIdentifier(uri=uri, version=version), content_changes=list(changes)
        )
    )


def edit(sl, sc, el, ec, text):
    return t.TextDocumentContentChangePartial(
        range=t.Range(start=t.Position(line=sl, character=sc), end=t.Position(line=el, character=ec)), text=text
    )


def completion(client, line, character, uri=URI):
    return client.text_document_completion_async(
        t.CompletionParams(text_document=t.TextDocumentIdentifier(uri=uri), position=t.Position(line, character))
    )
