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


def _human(n, units, step=1000.0, digits=1) -> str:
    if n is None:
        return "-"
    for unit in units:
        if abs(n) < step or unit == units[-1]:
            return f"{n:.{digits if unit != units[0] else 0}f}{unit}"
        n /= step
    return "-"


def _list(args) -> int:
    with Client() as kinfer:
        models = kinfer.request("model/list", {})["models"]
    if args.json:
        print(json.dumps(models))
        return 0
    rows = [["NAME", "SOURCE", "FORMAT", "SIZE", "ARCH", "PARAMS", "QUANT", "CONTEXT"]]
    for m in models:
        rows.append([
            m["name"] + (" *" if m.get("loaded") else ""),
            m["source"],
            m["format"],
            _human(m.get("sizeBytes"), [" B", " KB", " MB", " GB", " TB"]),
            m.get("architecture") or "-",
            _human(m.get("parameters"), ["", "K", "M", "B", "T"]),
            m.get("quantization") or "-",
            str(m["contextLength"]) if m.get("contextLength") else "-",
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {3, 5, 7}
    for r in rows:
        print("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    for m in models:
        if m.get("error"):
            print(m["error"] if m["name"] in m["error"] else f"{m['name']}: {m['error']}", file=sys.stderr)
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
