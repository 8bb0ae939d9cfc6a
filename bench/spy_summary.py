"""Where a profiled run's time goes, from py-spy's raw output (`py-spy record --native -f raw`):

    python bench/spy_summary.py PROFILE.txt [SUBSTRING ...]

Only the stacks holding one of the substrings count (e.g. `Engine.step`: the engine's steps).
Prints each frame's inclusive share of those samples, the frames most often on top, and the paths
under llama_decode (three frames deep), which is where llama.cpp prepares and queues a pass.
"""

from __future__ import annotations

import argparse
import collections
import re


def main():
    ap = argparse.ArgumentParser(description="where a py-spy profile's time goes")
    ap.add_argument("profile", help="py-spy record --native -f raw output")
    ap.add_argument("keep", nargs="*", help="only stacks holding one of these substrings")
    args = ap.parse_args()
    path, keep = args.profile, args.keep
    total = 0
    incl: collections.Counter = collections.Counter()
    leaf: collections.Counter = collections.Counter()
    under: collections.Counter = collections.Counter()
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        if not n.isdigit() or (keep and not any(k in stack for k in keep)):
            continue
        n = int(n)
        total += n
        names = [re.sub(r" \(.*\)$", "", f) for f in stack.split(";")]
        for f in set(names):
            incl[f] += n
        leaf[names[-1]] += n
        if "llama_decode" in names:
            i = names.index("llama_decode")
            under[" > ".join(names[i + 1 : i + 4])] += n
    print("samples", total)
    if not total:
        return
    for title, counts, k in (("inclusive", incl, 60), ("on top", leaf, 30), ("under llama_decode", under, 30)):
        print(f"--- {title}")
        for f, c in counts.most_common(k):
            print(f"{100 * c / total:6.1f}%  {f[:200]}")


if __name__ == "__main__":
    main()
