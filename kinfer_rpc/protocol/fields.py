"""Reading a JSON params object: each field as the type it must be, and every field the object has
but nobody read refused (a misspelt option silently ignored is the bug users hate most)."""

from __future__ import annotations

import builtins
from collections.abc import Collection
from typing import Any, overload

from kinfer_rpc import errors
from kinfer_rpc.host.options import INT_MAX, check_text


class Fields:
    """Reads fields out of one params object, recording which were used."""

    # The methods int, float, bool and str shadow the builtins in this class's scope: its
    # annotations name the builtins through `builtins`.

    def __init__(self, obj: object, where: builtins.str):
        if obj is None:
            obj = {}
        if not isinstance(obj, dict):
            raise errors.invalid_params(f"{where} must be an object")
        self.obj: dict[builtins.str, Any] = obj
        self.where = where
        self.used: set[builtins.str] = set()

    def _get(self, name: builtins.str) -> Any:
        self.used.add(name)
        return self.obj.get(name)

    def _bad(self, name: builtins.str, what: builtins.str) -> errors.KinferError:
        return errors.invalid_params(f"{self.where}.{name} must be {what}", {"field": f"{self.where}.{name}"})

    @overload
    def int(
        self,
        name: builtins.str,
        default: None = None,
        lo: builtins.int | None = None,
        hi: builtins.int | None = INT_MAX,
    ) -> builtins.int | None: ...

    @overload
    def int(
        self,
        name: builtins.str,
        default: builtins.int,
        lo: builtins.int | None = None,
        hi: builtins.int | None = INT_MAX,
    ) -> builtins.int: ...

    def int(
        self,
        name: builtins.str,
        default: builtins.int | None = None,
        lo: builtins.int | None = None,
        hi: builtins.int | None = INT_MAX,
    ) -> builtins.int | None:
        v = self._get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._bad(name, "an integer")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self._bad(name, f"between {lo} and {hi}")
        return v

    @overload
    def float(
        self,
        name: builtins.str,
        default: None = None,
        lo: builtins.float | None = None,
        hi: builtins.float | None = None,
    ) -> builtins.float | None: ...

    @overload
    def float(
        self,
        name: builtins.str,
        default: builtins.float,
        lo: builtins.float | None = None,
        hi: builtins.float | None = None,
    ) -> builtins.float: ...

    def float(
        self,
        name: builtins.str,
        default: builtins.float | None = None,
        lo: builtins.float | None = None,
        hi: builtins.float | None = None,
    ) -> builtins.float | None:
        v = self._get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            raise self._bad(name, "a number")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self._bad(name, f"between {lo} and {hi}")
        return float(v)

    @overload
    def bool(self, name: builtins.str, default: None = None) -> builtins.bool | None: ...

    @overload
    def bool(self, name: builtins.str, default: builtins.bool) -> builtins.bool: ...

    def bool(self, name: builtins.str, default: builtins.bool | None = None) -> builtins.bool | None:
        v = self._get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self._bad(name, "true or false")
        return v

    @overload
    def str(
        self, name: builtins.str, default: None = None, choices: Collection[builtins.str] | None = None
    ) -> builtins.str | None: ...

    @overload
    def str(
        self, name: builtins.str, default: builtins.str, choices: Collection[builtins.str] | None = None
    ) -> builtins.str: ...

    def str(
        self, name: builtins.str, default: builtins.str | None = None, choices: Collection[builtins.str] | None = None
    ) -> builtins.str | None:
        v = self._get(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise self._bad(name, "a string")
        check_text(v, f"{self.where}.{name}")
        if choices is not None and v not in choices:
            raise self._bad(name, "one of " + ", ".join(sorted(choices)))
        return v

    def raw(self, name: builtins.str) -> Any:
        return self._get(name)

    def done(self) -> None:
        extra = sorted(set(self.obj) - self.used)
        if extra:
            raise errors.invalid_params(
                f"unknown field{'s' if len(extra) > 1 else ''} in {self.where}: {', '.join(extra)}",
                {"unknown": extra},
            )
