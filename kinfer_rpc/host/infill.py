"""Fill-in-the-middle prompts: the text before and after a gap, and other files as context, in the
model's own FIM tokens (`inference/infill`, and `inference/generate` with a `suffix`).

The prompt is the one llama.cpp's server builds for `/infill` (its `format_infill`), token for
token:

    extra  [BOS]  [FIM_PRE] prefix  [FIM_SUF] suffix  [FIM_MID]  middle

`middle` is the start of the gap already written (an editor's current line before the cursor,
as llama.vim sends it): after [FIM_MID], so that typing on a line changes only the prompt's end
and the prefix pool keeps all the rest, in either order. (llama.cpp's server appends its
`prompt` to the prefix instead, before [FIM_SUF].)

`extra` is repository-level context: `[FIM_REP]myproject\\n` when the model has a repository token,
then each extra file as `[FIM_SEP]filename\\n` and its text (without a file separator token, the
text after a `\\n\\n--- snippet ---\\n\\n` line), then `[FIM_SEP]filename\\n` for the file being
edited. BOS only where the vocabulary adds one. Texts are tokenized as plain text (special-token
spellings in them are not special).

With `spm` (llama.cpp's `--spm-infill`, for models trained on that order) the suffix comes first:
`extra [BOS] [FIM_SUF] suffix [FIM_PRE] prefix [FIM_MID]`. Typing at the cursor then changes only
the prompt's end, so the prefix pool keeps all the rest; in the usual order the suffix, after the
edit, is read again at every keystroke.

When the context is short, what is far from the gap goes first, never the gap's surroundings: the
prefix keeps at most its last 3/4 of a batch of tokens (less 1/8 of a batch with a middle, which
keeps at most its last 1/8), the suffix its first 1/4 of a batch less 2, and the extra
context its last tokens that leave a batch and twice `maxTokens` of the context free (the batch
taken as at most the context less that room), as llama.cpp's server does; except that a prefix (or
middle) over its budget starts at a multiple of 1/8 of the budget from its beginning (so it keeps
7/8 to all of the budget), which keeps its start in place while someone types at its end.
`Prompt.dropped` says how many characters of each part were left out.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kinfer_rpc.types import FIM_KEYS, FillInMiddle, LoadedModel

# The usual spellings of each FIM token (llama.cpp's list), for models whose backend does not name
# them (FillInMiddle): looked for among the vocabulary's special tokens.
FAMILIES: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>", "<fim-sep>"),
}
REQUIRED = ("pre", "suf", "mid")  # what a prompt cannot do without
STOPS = ("pad", "rep", "sep")  # what ends a completion besides end of generation
REPO = "myproject\n"
CURRENT_FILE = "filename\n"
SNIPPET = "\n\n--- snippet ---\n\n"
DEFAULT_PREDICT = 128  # maxTokens the budgets leave room for when a request gives none
MARGIN = 16  # tokens tokenized beyond a budget when a text is cut to bound the work
WINDOW_STEPS = 8  # a long prefix's kept window moves in steps of 1/8 of its budget
CHUNK = 4096  # characters: where a long prefix is cut before tokenizing


def fim_tokens(model: LoadedModel) -> dict[str, int]:
    """The model's fill-in-the-middle tokens (keys of FIM_KEYS present in it)."""
    if isinstance(model, FillInMiddle):
        return {k: int(v) for k, v in model.fim_tokens().items() if k in FIM_KEYS and 0 <= v < model.info.n_vocab}
    found = {}
    for key in FIM_KEYS:
        for spelling in FAMILIES[key]:
            ids = model.tokenize(spelling, False, True)
            if len(ids) == 1 and model.tokenize(spelling, False, False) != ids:
                found[key] = ids[0]
                break
    return found


def missing(fim: dict[str, int]) -> list[str]:
    """The FIM tokens a prompt needs that the model lacks."""
    return [k for k in REQUIRED if k not in fim]


@attrs.frozen
class Prompt:
    tokens: list[int]
    # characters left out: from the prefix's start, the suffix's end, the extra context's start
    dropped: dict[str, int]


@attrs.frozen
class Budget:
    """How many tokens each part may keep (llama.cpp's split of a batch; with a middle, 1/8 of
    the batch taken from the prefix's share for it)."""

    prefix: int
    suffix: int
    extra: int
    middle: int = 0

    @classmethod
    def of(cls, n_batch: int, n_ctx: int, n_predict: int, *, middle: bool = False) -> Budget:
        room = 2 * n_predict
        n_batch = max(8, min(n_batch, n_ctx - room - 4))
        mid = n_batch // 8 if middle else 0
        return cls(3 * (n_batch // 4) - mid, max(0, n_batch // 4 - 2), max(0, n_ctx - n_batch - room), mid)


def build(
    model: LoadedModel,
    fim: dict[str, int],
    prefix: str,
    suffix: str,
    extra: Sequence[tuple[str, str]],
    budget: Budget,
    piece: int,
    *,
    spm: bool = False,
    middle: str | None = None,
) -> Prompt:
    """The infill prompt's tokens. `extra` is (filename, text) pairs; `piece` the most bytes one
    token stands for (bounds how much text is tokenized when a part is over its budget); `spm`:
    suffix before prefix (llama.cpp's --spm-infill); `middle`: the gap's start, after [FIM_MID]
    (the budget must have been made with `middle=True`)."""

    def tokenize(text: str) -> list[int]:
        return model.tokenize(text, False, False) if text else []

    def chars(tokens: Sequence[int]) -> int:
        return len(b"".join(model.token_bytes(t) for t in tokens).decode("utf-8", "ignore"))

    def tail(text: str, keep: int) -> list[int]:  # the last `keep` tokens or so (window_start)
        ids = tokenize(text[_cut(len(text), (keep + MARGIN) * piece) :])
        return ids[window_start(len(ids), keep) :]

    pre = tail(prefix, budget.prefix)
    mid = tail(middle, budget.middle) if middle else []
    suf = tokenize(suffix[: (budget.suffix + MARGIN) * piece])[: budget.suffix]
    extra_tokens, extra_chars = _extra(model, fim, extra, (budget.extra + MARGIN) * piece if budget.extra else 0)
    kept_extra = extra_tokens[len(extra_tokens) - min(len(extra_tokens), budget.extra) :]
    tokens = list(kept_extra)
    if model.info.add_bos:
        tokens += model.tokenize("", True, False)[:1]  # the vocabulary's BOS
    if spm:
        tokens += [fim["suf"], *suf, fim["pre"], *pre, fim["mid"], *mid]
    else:
        tokens += [fim["pre"], *pre, fim["suf"], *suf, fim["mid"], *mid]
    dropped = {
        "prefix": max(0, len(prefix) - chars(pre)),
        "suffix": max(0, len(suffix) - chars(suf)),
        "extra": max(0, extra_chars - chars(kept_extra)),
    }
    if middle is not None:
        dropped["middle"] = max(0, len(middle) - chars(mid))
    return Prompt(tokens, dropped)


def window_start(n: int, budget: int) -> int:
    """Where a prefix of `n` tokens starts being kept, for a budget of `budget`: the last `budget`
    tokens at most, the start moving in steps of 1/8 of the budget, so that typing at the end of
    a long prefix leaves its start (and the prefix pool's cells) where they were for a while."""
    over = n - budget
    if over <= 0:
        return 0
    step = max(1, budget // WINDOW_STEPS)
    return -(-over // step) * step


def _cut(length: int, limit: int) -> int:
    """Where to cut a text of `length` characters to keep its last `limit` or so: at a multiple of
    CHUNK, so that the cut stays put while the text grows at its end."""
    return max(0, length - limit) // CHUNK * CHUNK


def _extra(
    model: LoadedModel, fim: dict[str, int], extra: Sequence[tuple[str, str]], limit: int
) -> tuple[list[int], int]:
    """The extra context's tokens (only its last `limit` characters or so tokenized; 0: none) and
    how many characters the whole of it, with its separators, comes to."""
    sep, rep = fim.get("sep"), fim.get("rep")
    sep_chars = len(model.token_bytes(sep).decode("utf-8", "ignore")) if sep is not None else 0
    rep_chars = len(model.token_bytes(rep).decode("utf-8", "ignore")) if rep is not None else 0

    def head(filename: str) -> tuple[list[int], str]:  # a file's separator tokens and their text
        if sep is not None:
            return [sep], filename + "\n"
        return [], SNIPPET

    # Walk back from the end: the parts that fit in `limit` characters are tokenized.
    parts: list[list[int]] = []
    total = (rep_chars + len(REPO) if rep is not None else 0) + (
        sep_chars + len(CURRENT_FILE) if sep is not None else 0
    )
    total += sum(len(text) + (sep_chars + len(name) + 1 if sep is not None else len(SNIPPET)) for name, text in extra)
    left = limit
    if sep is not None and left > 0:
        parts.append([sep, *model.tokenize(CURRENT_FILE, False, False)])
        left -= sep_chars + len(CURRENT_FILE)
    for name, text in reversed(extra):
        if left <= 0:
            break
        cut = text[-left:] if len(text) > left else text
        body = model.tokenize(cut, False, False) if cut else []
        left -= len(cut)
        if cut is not text:
            parts.append(body)  # over the budget: what came before it is left out anyway
            break
        ids, sep_text = head(name)
        parts.append(ids + model.tokenize(sep_text, False, False) + body)
        left -= sep_chars + len(sep_text)
    else:
        if rep is not None and left > 0:
            parts.append([rep, *model.tokenize(REPO, False, False)])
    return [t for part in reversed(parts) for t in part], total


def trim_repeated_suffix(text: str, suffix: str) -> str:
    """A completion that ends by repeating the whole suffix (trailing blanks aside) loses the repeat,
    as llama-cpp-python's infill example does: the suffix is already in the file."""
    tail = suffix.rstrip()
    body = text.rstrip()
    if tail and body.endswith(tail):
        return body[: -len(tail)]
    return text
