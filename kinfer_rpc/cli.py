"""`kinfer`: the command line for people. It speaks to `kinfer-rpc` like any client does."""

from __future__ import annotations

import argparse
import json
import sys

from .client import Client, RpcError


def _chat(args) -> int:
    options = {"maxTokens": args.max_tokens, "temperature": args.temperature}
    if args.seed is not None:
        options["seed"] = args.seed
    with Client() as kinfer:
        history: list[dict] = []
        prompts = [args.prompt] if args.prompt else None
        while True:
            if prompts is not None:
                if not prompts:
                    return 0
                text = prompts.pop()
            else:
                try:
                    text = input(">>> ")
                except EOFError:
                    print()
                    return 0
                if text.strip() in ("/bye", "/exit"):
                    return 0
            history.append({"role": "user", "content": text})
            if args.json:
                result = kinfer.request("inference/chat", {"model": args.model, "messages": history, "options": options}
                                        if args.model else {"messages": history, "options": options})
                print(json.dumps(result))
                reply = result["text"]
            else:
                reply = ""
                for piece in kinfer.stream_chat(history, args.model, **options):
                    reply += piece
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                sys.stdout.write("\n")
            history.append({"role": "assistant", "content": reply})


def _list(args) -> int:
    with Client() as kinfer:
        models = kinfer.request("model/list", {})["models"]
    if args.json:
        print(json.dumps(models))
        return 0
    width = max([len(m["name"]) for m in models] + [4])
    print(f"{'NAME':<{width}}  {'SOURCE':<8}  {'FORMAT':<6}  {'SIZE':>9}  PATH")
    for m in models:
        print(f"{m['name']:<{width}}  {m['source']:<8}  {m['format']:<6}  {m['sizeBytes'] / 2**20:>7.1f}MB  {m['path']}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kinfer", description="kinfer-rpc for people")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="chat with a model (interactive without a prompt)")
    chat.add_argument("model", nargs="?", default=None, help="model name (default: the embedded SmolLM2)")
    chat.add_argument("prompt", nargs="?", default=None)
    chat.add_argument("--max-tokens", type=int, default=512)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--seed", type=int, default=None)
    sub.add_parser("list", help="list the models this machine can serve")
    args = parser.parse_args(argv)
    if args.command == "chat" and args.model and args.prompt is None and " " in args.model:
        args.model, args.prompt = None, args.model  # `kinfer chat "a question"`
    try:
        return {"chat": _chat, "list": _list}[args.command](args)
    except RpcError as exc:
        print(f"kinfer: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
