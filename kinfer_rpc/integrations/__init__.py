"""Adapters that put kinfer under other tools' interfaces, with no server to run.

- `kinfer_rpc.integrations.langchain`: `ChatKinfer`, a LangChain chat model.
- `kinfer_rpc.integrations.llm_kinfer`: the plugin of Simon Willison's `llm` (`llm -m kinfer/NAME`).

Both talk to kinfer through the Python client (kinfer_rpc.client), over a `kinfer-rpc` of this
process's own or attached to the daemon (`kinfer serve`); `connection` says which, and shares one
server between every adapter object of the process. docs/agents.md shows them at work.
"""
