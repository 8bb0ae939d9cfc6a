"""`kinfer`: the command line for people. It speaks to `kinfer-rpc` like any client does.

    kinfer chat [-m MODEL] [PROMPT]  chat (interactive without a prompt; without -m, the config
                                     file's model or the embedded SmolLM2); --format FILE|json
                                     holds the reply to a JSON schema, --tool FILE offers tools
    kinfer run MODEL [PROMPT]        the same, the model named first (as Ollama spells it) or -m
    kinfer list                      the models this machine can serve (--wide: every column)
    kinfer show NAME                 a model: header, its own parameters, template, system message,
                                     license (--template, --system, --parameters, --license: one)
    kinfer ps                        the kinfer-rpc processes running here: state (idle, loading,
                                     busy), requests running, the models they hold
    kinfer pull NAME                 a model from Ollama's registry (qwen3:0.6b) or Hugging Face
                                     (hf.co/ORG/REPO:QUANT) into kinfer's folder, resumable
    kinfer rm NAME...                delete models pulled into kinfer's folder (never Ollama's)
    kinfer bench                     concurrent chats through the client; tokens per second
    kinfer doctor                    libllama, plugins (and where from), devices, memory, the stores
    kinfer serve, kinfer stop        the daemon every kinfer and `kinfer-rpc --attach` share
    kinfer rpc-server                serve this host's devices to kinfer-rpc on another host
                                     (llama.cpp's RPC server)
    kinfer setup                     build kinfer's llama.cpp (CUDA where nvcc is found) into
                                     $KINFER_HOME/llama/lib, which kinfer then loads
    kinfer completion bash|zsh|fish  the shell's completion script

`kinfer` alone prints the help. Every command takes `--json` for scripts (errors too are a JSON
document on stdout, `{"error": {"message", "steps", "code"}}`). Colours and progress bars only on a
terminal (and never with NO_COLOR set). Errors say what to do next: an unknown model the closest
names and the `kinfer pull` line, a misspelt command, option or parameter the closest spelling. A
chat sends only the options given (--max-tokens, --temperature, --seed, -o NAME VALUE for any
other, or the config file's [options]), so a model's own parameters (an Ollama model's
temperature, num_predict...) apply otherwise. The server's log goes to stderr at --log-level
(default error: llama.cpp's warnings stay out of a reply).

As `ollama run` does: piped stdin is the question (before the prompt, if one is given), answered
once; at a terminal, the chat is interactive, with line editing, a history kept in
~/.kinfer/history, \"\"\" ... \"\"\" for a multi-line message, replies wrapped at word
boundaries and /commands (/? lists them). Ctrl-C stops a reply (the server cancels it and goes
on); at an empty prompt, a second Ctrl-C or Ctrl-D leaves.
"""

from __future__ import annotations

from kinfer_rpc.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
