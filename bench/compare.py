"""kinfer's engine against llama.cpp's own tools, side by side in one run, on one model.

    python bench/compare.py MODEL.gguf --tools DIR [--threads N] [--anchor-threads 2,8] [--ngl 99] [--npl 1,8,32,128]

Runs `llama-bench` (tg) and `llama-batched-bench` (decode with N at once) from DIR, then
bench/engine_bench.py with the same shapes, and prints a markdown table with the ratios plus the
raw JSON lines (to keep beside docs/performance.md). `--threads`: both sides' CPU threads (by
default the machine's CPU count). `--anchor-threads A,B`: llama.cpp's tools run at each of these
and the fastest figure of each case is the anchor, while kinfer runs at `--threads`, or at its own
default for the load when `--threads` is not given (2 with every layer on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

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
    ap.add_argument("--pool", action="store_true",
                    help="kinfer with its prefix pool (on per-slot streams) against llama-batched-bench -kvu")
    ap.add_argument("--label", default="")
    ap.add_argument("--kv-type", default="f16", choices=["f16", "q8_0"],
                    help="KV cells for both sides (kinfer's CPU default is q8_0, for invariance)")
    args = ap.parse_args()
    npl = [int(x) for x in args.npl.split(",")]
    ours_t = args.threads
    anchor_t = (args.anchor_threads or str(args.threads or os.cpu_count())).split(",")

    tg = jsonl([os.path.join(args.tools, "llama-bench"), "-m", args.model, "-p", "0", "-n", str(args.ntg),
                "-fa", "1", "-t", ",".join(anchor_t), "-ngl", str(args.ngl), "-r", "3", "-o", "jsonl",
                "-ctk", args.kv_type, "-ctv", args.kv_type])
    llama_tg = max(r["avg_ts"] for r in tg if r.get("n_gen") == args.ntg)
    ctx = max(npl) * (args.npp + args.ntg + 8)
    bb: dict = {}
    for t in anchor_t:  # the fastest run of each case, over the thread counts
        bb_cmd = [os.path.join(args.tools, "llama-batched-bench"), "-m", args.model, "-c", str(ctx), "-b", "2048",
                  "-ub", "512", "-npp", str(args.npp), "-ntg", str(args.ntg), "-npl", args.npl, "-fa", "on",
                  "-t", t, "-tb", t, "-ngl", str(args.ngl), "--output-format", "jsonl",
                  "-ctk", args.kv_type, "-ctv", args.kv_type]
        if args.kvu or args.pool:
            bb_cmd.append("-kvu")
        for r in jsonl(bb_cmd):
            if "speed_tg" in r and (r["pl"] not in bb or r["speed_tg"] > bb[r["pl"]]["speed_tg"]):
                bb[r["pl"]] = {**r, "threads": int(t)}

    ours_cmd = [sys.executable, os.path.join(HERE, "engine_bench.py"), args.model, "--npp", str(args.npp),
                "--ntg", str(args.ntg), "--npl", args.npl, "--gpu-layers", str(args.ngl), "--tg",
                "--kv-type", args.kv_type, "--phases"] + (["--threads", str(ours_t)] if ours_t else [])
    if args.kvu:
        ours_cmd.append("--kvu")
    ours_cmd += ["--prefix", str(1 << 30 if args.pool else -1)]
    ours = jsonl(ours_cmd)
    ours_tg = next(r for r in ours if r["case"] == "tg")
    ours_bb = {r["npl"]: r for r in ours if r["case"] == "batched"}

    label = args.label or os.path.basename(args.model)
    mode = " (kinfer's prefix pool vs -kvu)" if args.pool else " (-kvu)" if args.kvu else " (prefix -1 vs no -kvu)"
    print(f"\n#### {label}{mode}, {args.kv_type} KV cells on both sides\n")
    print(f"Threads: kinfer {ours_t or 'its default'}; llama.cpp {', '.join(anchor_t)}, the fastest of each case.\n")
    print("| case | llama.cpp tok/s | kinfer tok/s | kinfer / llama.cpp |")
    print("|---|---:|---:|---:|")
    print(f"| single stream, tg{args.ntg} (llama-bench) | {llama_tg:,.1f} | {ours_tg['decode_tps']:,.1f} | "
          f"{ours_tg['decode_tps'] / llama_tg:.0%} |")
    for n in npl:
        a, b = bb[n]["speed_tg"], ours_bb[n]["decode_tps"]
        print(f"| {n} at once, decode (llama-batched-bench S_TG, pp{args.npp} tg{args.ntg}) | {a:,.1f} | {b:,.1f} | {b / a:.0%} |")
    # Where kinfer's decode step goes (engine_bench --phases), beside llama.cpp's whole step.
    # The gap: from the end of one pass's wait to the next decode() call, the device idle.
    print("\n| at once | llama.cpp ms a step | kinfer ms a step | in decode() | waiting | engine host | of it argmax"
          " | of it planning | gap, device idle |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in npl:
        r = ours_bb[n]
        if "ms_step" in r:
            print(f"| {n} | {1000 * n / bb[n]['speed_tg']:.2f} | {r['ms_step']:.2f} | {r['ms_decode_call']:.2f} |"
                  f" {r['ms_wait']:.2f} | {r['ms_engine_host']:.2f} | {r.get('ms_argmax', 0):.2f} | {r.get('ms_plan', 0):.2f} |"
                  f" {r.get('ms_gap', 0):.2f} |")
    print("\n<details><summary>raw</summary>\n")
    for r in tg + list(bb.values()) + ours:
        print("    " + json.dumps(r))
    print("\n</details>")


if __name__ == "__main__":
    main()
