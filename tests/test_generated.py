"""The clients' wire types and error tables are generated from spec/metaModel.json
(spec/generate.py): the files on disk are what it writes now, and they carry every code and
structure of the meta model."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import typing

from paths import ROOT

from kinfer_rpc.client import ERRORS, RpcError, shapes

SCRIPT = ROOT / "spec" / "generate.py"
META = json.loads((ROOT / "spec" / "metaModel.json").read_text())


def _generate():
    spec = importlib.util.spec_from_file_location("generate", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_files_are_current():
    run = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_every_documented_error_code_raises_its_own_class():
    (codes,) = [e for e in META["enumerations"] if e["name"] == "ErrorCodes"]
    for v in codes["values"]:
        cls = ERRORS[v["value"]]
        assert cls.__name__ == v["name"] and issubclass(cls, RpcError) and cls.CODE == v["value"]
        assert cls.__doc__ and str(v["value"]) in cls.__doc__


def test_every_structure_is_a_typed_dict_with_its_optional_properties():
    for s in META["structures"]:
        td = getattr(shapes, s["name"])
        own = {p["name"]: p.get("optional", False) for p in s["properties"]}
        for name, optional in own.items():
            assert name in td.__annotations__, (s["name"], name)
            assert (name in td.__optional_keys__) == optional, (s["name"], name)
    hints = typing.get_type_hints(shapes.InferenceResult)
    assert hints["tokens"] == list[int] and hints["model"] is str


def test_a_change_to_the_meta_model_is_a_stale_file(tmp_path, monkeypatch):
    generate = _generate()
    meta = json.loads(json.dumps(META))
    (codes,) = [e for e in meta["enumerations"] if e["name"] == "ErrorCodes"]
    codes["values"].append({"name": "TooSleepy", "value": -31999, "documentation": "kinfer. Asleep."})
    changed = tmp_path / "metaModel.json"
    changed.write_text(json.dumps(meta))
    monkeypatch.setattr(generate, "META", changed)
    stale = {p.name for p in generate.stale()}
    assert stale == {"errors.py", "shapes.py", "protocol.d.ts", "protocol.js"}, stale
    out = generate.outputs()
    assert "class TooSleepy(RpcError):" in out[ROOT / "kinfer_rpc" / "client" / "errors.py"]
    assert "TooSleepy: -31999," in out[ROOT / "clients" / "node" / "protocol.js"]
