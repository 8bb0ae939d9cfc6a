"""Write a tiny vision projector GGUF with random weights (llama.cpp's mtmd "mmproj" file) for a
text model of `--embd` dimensions (SmolLM2-135M's 576 by default): the plumbing of images is
tested with it where no vision model's weights can be had. It sees nothing: its image tokens are
random vectors, so a reply about an image says nothing of the picture.

    python tests/modelgen/make_vision_projector.py OUT.gguf [--embd 576]

or, from a test, `make_vision_projector(dst_path)` (returns dst_path).

The projector is LLaVA's (`clip.projector_type` "mlp"): a CLIP vision transformer of two blocks
over 32x32 pixels in 8x8 patches (16 image tokens an image), then two linear layers with a GELU
between them into the text model's embeddings. Needs the `gguf` package.
"""

from __future__ import annotations

import argparse
import os
import struct
import zlib

import numpy as np

IMAGE_SIZE = 32
PATCH = 8
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2  # an image's positions in the prompt


def png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A PNG file of one colour (the tests' images)."""
    raw = b"".join(b"\0" + bytes(rgb) * width for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def make_vision_projector(dst: str | os.PathLike[str], embd: int = 576, seed: int = 0) -> str:
    import gguf

    v_embd, v_ff, v_layers, v_heads, hidden = 64, 128, 2, 4, 128
    rng = np.random.default_rng(seed)

    def rand(*shape: int, dtype: type = np.float16) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.05).astype(dtype)

    w = gguf.GGUFWriter(os.fspath(dst), "clip")
    w.add_name("synthetic-vision-projector")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "mlp")
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    w.add_uint32("clip.vision.patch_size", PATCH)
    w.add_uint32("clip.vision.embedding_length", v_embd)
    w.add_uint32("clip.vision.feed_forward_length", v_ff)
    w.add_uint32("clip.vision.block_count", v_layers)
    w.add_uint32("clip.vision.projection_dim", embd)
    w.add_uint32("clip.vision.attention.head_count", v_heads)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    ones = np.ones(v_embd, dtype=np.float32)
    zeros = np.zeros(v_embd, dtype=np.float32)
    # numpy shapes are PyTorch's (out, in): GGUF stores them reversed, as ggml reads them
    w.add_tensor("v.patch_embd.weight", rand(v_embd, 3, PATCH, PATCH))
    w.add_tensor("v.patch_embd.bias", rand(v_embd, dtype=np.float32))
    w.add_tensor("v.position_embd.weight", rand(TOKENS_PER_IMAGE, v_embd, dtype=np.float32))
    w.add_tensor("v.pre_ln.weight", ones)
    w.add_tensor("v.pre_ln.bias", zeros)
    for i in range(v_layers):
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"v.blk.{i}.{name}.weight", rand(v_embd, v_embd))
            w.add_tensor(f"v.blk.{i}.{name}.bias", rand(v_embd, dtype=np.float32))
        for name in ("ln1", "ln2"):
            w.add_tensor(f"v.blk.{i}.{name}.weight", ones)
            w.add_tensor(f"v.blk.{i}.{name}.bias", zeros)
        w.add_tensor(f"v.blk.{i}.ffn_up.weight", rand(v_ff, v_embd))
        w.add_tensor(f"v.blk.{i}.ffn_up.bias", rand(v_ff, dtype=np.float32))
        w.add_tensor(f"v.blk.{i}.ffn_down.weight", rand(v_embd, v_ff))
        w.add_tensor(f"v.blk.{i}.ffn_down.bias", rand(v_embd, dtype=np.float32))
    w.add_tensor("mm.0.weight", rand(hidden, v_embd))
    w.add_tensor("mm.0.bias", rand(hidden, dtype=np.float32))
    w.add_tensor("mm.2.weight", rand(embd, hidden))
    w.add_tensor("mm.2.bias", rand(embd, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(dst)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--embd", type=int, default=576, help="the text model's embedding size")
    args = ap.parse_args()
    print(make_vision_projector(args.out, args.embd))


if __name__ == "__main__":
    main()
