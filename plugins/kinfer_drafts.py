"""Built-in draft policies for speculative decoding.

`ngram` is prompt lookup: the tokens that followed the last earlier occurrence of the request's
latest n-gram (n from 4 down to 1) in its own prompt and reply. Editors and agents rewrite text
they were given, so the reply keeps running into its own prompt; no extra weights are needed.
"""

from __future__ import annotations

import numpy as np

import kinfer_rpc


class NgramPolicy:
    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, history, k: int) -> list[int]:
        n_hist = len(history)
        if k <= 0 or n_hist < 2:
            return []
        h = np.asarray(history, dtype=np.int64)
        for n in range(min(self.max_n, n_hist - 1), self.min_n - 1, -1):
            tail = h[n_hist - n :]
            # Earlier windows h[i:i+n] (i + n < n_hist) equal to the tail; take the latest one.
            span = n_hist - n
            match = np.ones(span, dtype=bool)
            for j in range(n):
                match &= h[j : j + span] == tail[j]
            hits = np.flatnonzero(match)
            if hits.size:
                start = int(hits[-1]) + n
                return h[start : start + k].tolist()
        return []


@kinfer_rpc.hookimpl
def register_draft_policies(register):
    register(NgramPolicy())
