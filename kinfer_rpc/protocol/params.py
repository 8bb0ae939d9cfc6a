"""Turning JSON params into checked values at the edge, so the inside never re-checks.

Every error names the field and what was wrong; unknown fields are errors (a misspelt option
silently ignored is the bug users hate most).
"""

from __future__ import annotations

from kinfer_rpc import errors
from kinfer_rpc.engine.scheduler import GenerateOptions
from kinfer_rpc.engine.sampling import SamplingOptions

INT_MAX = 2**31 - 1


class Fields:
    """Reads fields out of one params object, recording which were used."""

    def __init__(self, obj, where: str):
        if obj is None:
            obj = {}
        if not isinstance(obj, dict):
            raise errors.invalid_params(f"{where} must be an object")
        self.obj = obj
        self.where = where
        self.used: set[str] = set()

    def _get(self, name):
        self.used.add(name)
        return self.obj.get(name)

    def _bad(self, name, what):
        return errors.invalid_params(f"{self.where}.{name} must be {what}", {"field": f"{self.where}.{name}"})

    def int(self, name, default=None, lo=None, hi=INT_MAX):
        v = self._get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._bad(name, "an integer")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self._bad(name, f"between {lo} and {hi}")
        return v

    def float(self, name, default=None, lo=None, hi=None):
        v = self._get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            raise self._bad(name, "a number")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self._bad(name, f"between {lo} and {hi}")
        return float(v)

    def bool(self, name, default=None):
        v = self._get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self._bad(name, "true or false")
        return v

    def str(self, name, default=None, choices=None):
        v = self._get(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise self._bad(name, "a string")
        _check_text(v, f"{self.where}.{name}")
        if choices is not None and v not in choices:
            raise self._bad(name, "one of " + ", ".join(sorted(choices)))
        return v

    def raw(self, name):
        return self._get(name)

    def done(self):
        extra = sorted(set(self.obj) - self.used)
        if extra:
            raise errors.invalid_params(
                f"unknown field{'s' if len(extra) > 1 else ''} in {self.where}: {', '.join(extra)}",
                {"unknown": extra},
            )


def _check_text(value: str, where: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise errors.invalid_params(f"{where} is not valid Unicode (a lone surrogate?)") from None


def generate_options(obj, seed_default: int) -> GenerateOptions:
    f = Fields(obj, "options")
    max_tokens = f.int("maxTokens", None, lo=0)
    stop = f.raw("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        _check_text(stop, "options.stop")
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
        for s in stop:
            _check_text(s, "options.stop")
    else:
        raise errors.invalid_params("options.stop must be a string or a list of strings")
    sampling = SamplingOptions(
        temperature=f.float("temperature", 0.8, lo=0.0, hi=100.0),
        top_k=f.int("topK", 40, lo=0),
        top_p=f.float("topP", 0.95, lo=0.0, hi=1.0),
        min_p=f.float("minP", 0.05, lo=0.0, hi=1.0),
        repeat_penalty=f.float("repeatPenalty", 1.0, lo=0.01, hi=100.0),
        repeat_last_n=f.int("repeatLastN", 64, lo=-1),
        seed=f.int("seed", seed_default, lo=0, hi=2**63 - 1),
    )
    ignore_eos = f.bool("ignoreEos", False)
    drafts = f.int("drafts", None, lo=0, hi=64)
    policy = f.str("draftPolicy", None)
    f.done()
    return GenerateOptions(
        max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos, sampling=sampling,
        drafts=drafts, draft_policy=policy,
    )


def messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise errors.invalid_params("messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise errors.invalid_params(f"messages[{i}] must be an object with string role and content")
        _check_text(m["role"], f"messages[{i}].role")
        _check_text(m["content"], f"messages[{i}].content")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def tokens(value, n_vocab: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise errors.invalid_params("tokens must be a list of integers")
    bad = [t for t in value if not 0 <= t < n_vocab]
    if bad:
        raise errors.invalid_params(f"token ids out of the vocabulary (0..{n_vocab - 1}): {bad[:5]}")
    return list(value)
