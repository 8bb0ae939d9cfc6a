"""kinfer's engine against llama.cpp's own tools, side by side in one run, on one model.

    python bench/compare.py MODEL.gguf --tools DIR [--threads N] [--anchor-threads 2,8] [--ngl 99] [--npl 1,8,32,128]

Runs `llama-bench` (tg) and `llama-batched-bench` (decode with N at once) from DIR, then
bench/engine_bench.py with the same shapes, and prints a markdown table with the ratios plus the
raw JSON lines (to keep beside docs/performance.md). `--threads`: both sides' CPU threads (by
default the machine's CPU count). `--anchor-threads A,B`: llama.cpp's tools run at each of these
and the fastest figure of each case is the anchor, while kinfer runs at `--threads`, or at its own
default for the load when `--threads` is not given (2 with every layer on a GPU).

`--rounds R` runs llama-batched-bench and kinfer's engine R times, alternating, and reports for
each N the median of the R rounds' ratios (each kinfer run against the stock llama-batched-bench
run of its round), with every round's ratio beside it. `--patched-lib DIR` also runs
llama-batched-bench on the libllama in DIR (kinfer's patched build, patches/README.md) in each
round, between the two: llama.cpp's own loop on the library kinfer runs on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))


def jsonl(cmd: list[str], env=None) -> list[dict]:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"{cmd[0]} failed with {out.returncode}")
    rows = []
    for line in (out.stdout + "\n" + out.stderr).splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tools", required=True, help="folder with llama-bench and llama-batched-bench")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--anchor-threads", default=None, help="comma list: llama.cpp's tools at each, the fastest kept")
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument("--npp", type=int, default=128)
    ap.add_argument("--ntg", type=int, default=128)
    ap.add_argument("--npl", default="1,8,32,128")
    ap.add_argument("--kvu", action="store_true", help="llama-batched-bench -kvu and kinfer's unified buffer")
    ap.add_argument(
        "--pool",
        action="store_true",
        help="kinfer with its prefix pool (on per-slot streams) against llama-batched-bench -kvu",
    )
    ap.add_argument("--label", default="")
    ap.add_argument("--rounds", type=int, default=1, help="llama-batched-bench and kinfer alternating, this many times")
    ap.add_argument(
        "--patched-lib",
        default=None,
        help="a folder with kinfer's patched libllama: also run llama-batched-bench on it",
    )
    ap.add_argument(
        "--kv-type",
        default="f16",
        choices=["f16", "q8_0"],
        help="KV cells for both sides (kinfer's CPU default is q8_0, for invariance)",
    )
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be 1 or more")
    if args.patched_lib and not os.path.exists(os.path.join(args.patched_lib, "libllama.so")):
        ap.error(f"--patched-lib: no libllama.so in {args.patched_lib}")
    npl = [int(x) for x in args.npl.split(",")]
    ours_t = args.threads
    anchor_t = (args.anchor_threads or str(args.threads or os.cpu_count())).split(",")

    tg = jsonl(
        [
            os.path.join(args.tools, "llama-bench"),
            "-m",
            args.model,
            "-p",
            "0",
            "-n",
            str(args.ntg),
            "-fa",
            "1",
            "-t",
            ",".join(anchor_t),
            "-ngl",
            str(args.ngl),
            "-r",
            "3",
            "-o",
            "jsonl",
            "-ctk",
            args.kv_type,
            "-ctv",
            args.kv_type,
        ]
    )
    llama_tg = max(r["avg_ts"] for r in tg if r.get("n_gen") == args.ntg)
    ctx = max(npl) * (args.npp + args.ntg + 8)

    def batched_bench(env=None) -> dict:
        bb: dict = {}
        for t in anchor_t:  # the fastest run of each case, over the thread counts
            bb_cmd = [
                os.path.join(args.tools, "llama-batched-bench"),
                "-m",
                args.model,
                "-c",
                str(ctx),
                "-b",
                "2048",
                "-ub",
                "512",
                "-npp",
                str(args.npp),
                "-ntg",
                str(args.ntg),
                "-npl",
                args.npl,
                "-fa",
                "on",
                "-t",
                t,
                "-tb",
                t,
                "-ngl",
                str(args.ngl),
                "--output-format",
                "jsonl",
                "-ctk",
                args.kv_type,
                "-ctv",
                args.kv_type,
            ]
            if args.kvu or args.pool:
                bb_cmd.append("-kvu")
            for r in jsonl(bb_cmd, env):
                if "speed_tg" in r and (r["pl"] not in bb or r["speed_tg"] > bb[r["pl"]]["speed_tg"]):
                    bb[r["pl"]] = {**r, "threads": int(t)}
        return bb

    patched_env = None
    if args.patched_lib:
        paths = [args.patched_lib] + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
        patched_env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(paths)}
    ours_cmd = [
        sys.executable,
        os.path.join(HERE, "engine_bench.py"),
        args.model,
        "--npp",
        str(args.npp),
        "--ntg",
        str(args.ntg),
        "--npl",
        args.npl,
        "--gpu-layers",
        str(args.ngl),
        "--kv-type",
        args.kv_type,
        "--phases",
    ] + (["--threads", str(ours_t)] if ours_t else [])
    if args.kvu:
        ours_cmd.append("--kvu")
    ours_cmd += ["--prefix", str(1 << 30 if args.pool else -1)]
    rounds = []  # (llama-batched-bench by N, on the patched lib by N, kinfer by N, kinfer's tg)
    raw = list(tg)
    for i in range(args.rounds):
        bb = batched_bench()
        bbp = batched_bench(patched_env) if patched_env else {}
        ours = jsonl(ours_cmd + (["--tg"] if i == 0 else []))
        for r in ours:
            r["round"] = i + 1
        raw += [{**r, "round": i + 1} for r in bb.values()]
        raw += [{**r, "round": i + 1, "lib": "patched"} for r in bbp.values()]
        raw += ours
        rounds.append(
            (
                bb,
                bbp,
                {r["npl"]: r for r in ours if r["case"] == "batched"},
                next((r for r in ours if r["case"] == "tg"), None),
            )
        )
    ours_tg = rounds[0][3]

    label = args.label or os.path.basename(args.model)
    mode = " (kinfer's prefix pool vs -kvu)" if args.pool else " (-kvu)" if args.kvu else " (prefix -1 vs no -kvu)"
    print(f"\n#### {label}{mode}, {args.kv_type} KV cells on both sides\n")
    print(f"Threads: kinfer {ours_t or 'its default'}; llama.cpp {', '.join(anchor_t)}, the fastest of each case.")
    if args.rounds > 1:
        print(f"{args.rounds} rounds, llama-batched-bench and kinfer alternating: medians, and each round's ratio.")
    print()
    patched_cols = " | llama-batched-bench on the patched libllama" if patched_env else ""
    print(f"| case | llama.cpp tok/s | kinfer tok/s | kinfer / llama.cpp | each round{patched_cols} |")
    print("|---|---:|---:|---:|---|" + ("---:|" if patched_env else ""))
    pad = " |" if patched_env else ""
    print(
        f"| single stream, tg{args.ntg} (llama-bench) | {llama_tg:,.1f} | {ours_tg['decode_tps']:,.1f} | "
        f"{ours_tg['decode_tps'] / llama_tg:.0%} | |{pad}"
    )
    for n in npl:
        a = median([r[0][n]["speed_tg"] for r in rounds])
        b = median([r[2][n]["decode_tps"] for r in rounds])
        ratios = [r[2][n]["decode_tps"] / r[0][n]["speed_tg"] for r in rounds]
        each = ", ".join(f"{x:.0%}" for x in ratios)
        extra = f" {median([r[1][n]['speed_tg'] for r in rounds]):,.1f} |" if patched_env else ""
        print(
            f"| {n} at once, decode (llama-batched-bench S_TG, pp{args.npp} tg{args.ntg}) | {a:,.1f} | {b:,.1f} |"
            f" {median(ratios):.0%} | {each} |{extra}"
        )
    # Where kinfer's decode step goes (engine_bench --phases), beside llama.cpp's whole step: the
    # medians over the rounds. The gap: from the end of one pass's wait to the next decode() call,
    # the device idle.
    print(
        "\n| at once | llama.cpp ms a step | kinfer ms a step | in decode() | waiting | engine host | of it argmax"
        " | of it planning | gap, device idle |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in npl:
        if all("ms_step" in r[2][n] for r in rounds):
            m = {
                k: median([r[2][n][k] for r in rounds])
                for k in ("ms_step", "ms_decode_call", "ms_wait", "ms_engine_host", "ms_argmax", "ms_plan", "ms_gap")
            }
            bb_ms = median([1000 * n / r[0][n]["speed_tg"] for r in rounds])
            print(
                f"| {n} | {bb_ms:.2f} | {m['ms_step']:.2f} | {m['ms_decode_call']:.2f} |"
                f" {m['ms_wait']:.2f} | {m['ms_engine_host']:.2f} | {m['ms_argmax']:.2f} | {m['ms_plan']:.2f} |"
                f" {m['ms_gap']:.2f} |"
            )
    print("\n<details><summary>raw</summary>\n")
    for r in raw:
        print("    " + json.dumps(r))
    print("\n</details>")


if __name__ == "__main__":
    main()
