"""The backend and the `mtp` draft policy the plugin registers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kinfer_rpc.default_plugins.llama import buft, library, rpc
from kinfer_rpc.default_plugins.llama.model import LlamaModel
from kinfer_rpc.types import (
    Backend,
    DraftRequest,
    GpuInfo,
    LoadedModel,
    LoadOptions,
    MachineInfo,
)


class LlamaBackend:
    """llama.cpp: reads GGUF."""

    name = "llama"
    formats: tuple[str, ...] = ("gguf",)

    def machine(self) -> MachineInfo:
        """Each GPU's memory as ggml's devices report it, in llama.cpp's device order (that of
        tensor_split and main_gpu), and the host's available memory."""
        L = library.load()
        gpus = [d for d in buft.Ggml().devices() if d["type"] == buft.DEVICE_GPU]
        if not L.llama_supports_gpu_offload():
            gpus = []
        return MachineInfo.of_gpus(
            (GpuInfo(d["name"], d["free"], d["total"]) for d in gpus), host_free_bytes=MachineInfo.host_available()
        )

    def load(self, path: str, options: LoadOptions, progress: Callable[[float], None]) -> LoadedModel:
        """A model that generates, or one that embeds where its GGUF declares a pooling
        (embed.py): llama.cpp runs the two in different kinds of context."""
        from kinfer_rpc.default_plugins.llama.embed import LlamaEmbedder, declared_pooling

        pooling, dimensions = declared_pooling(path)
        if pooling is not None:
            if options.projector:
                raise ValueError("an embedding model takes no vision projector (options.projector)")
            return LlamaEmbedder(path, options, progress, pooling, dimensions)
        return LlamaModel(path, options, progress)

    def features(self) -> dict[str, Any]:
        """Whether its llama.cpp can spread a model over RPC servers (options.rpcServers), found
        from the library files, without loading them; and that it embeds (a GGUF that declares a
        pooling loads as an embedding model or reranker: embed.py); and whether it reads images
        (a model loaded with its projector, through llama.cpp's libmtmd: vision.py)."""
        from kinfer_rpc.default_plugins.llama import vision

        ok, why = rpc.build_support()
        seeing, blind = vision.available()
        return {
            "rpc": ok,
            **({"rpcUnavailable": why} if not ok else {}),
            "embeddings": True,
            "vision": seeing,
            **({"visionUnavailable": blind} if not seeing else {}),
        }


class MtpPolicy:
    """`mtp`: the target model's own multi-token-prediction layers draft (GLM-4.5-style NextN
    blocks, loaded with model/load's draftPolicy "mtp"). One session per load; every step it
    drafts k tokens for all drafting requests, one MTP pass per draft position."""

    name = "mtp"

    def session(self, target: LoadedModel, backend: Backend, options: LoadOptions) -> MtpSession:
        return MtpSession(target)


class MtpSession:
    def __init__(self, target: LoadedModel) -> None:
        if not isinstance(target, LlamaModel):
            raise ValueError("draftPolicy mtp needs the llama backend (llama.cpp's multi-token-prediction API)")
        if target._mtp is None:
            raise ValueError(
                "draftPolicy mtp needs the model loaded with its multi-token-prediction layers "
                '(model/load with draftPolicy "mtp")'
            )
        self.target: LlamaModel = target

    def propose_many(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        mtp = self.target._mtp
        if mtp is None:
            raise RuntimeError("the model's multi-token-prediction context is closed")
        return mtp.propose_many(requests)

    def close(self) -> None:
        pass  # the MTP context belongs to the model (its mirror follows every pass); it closes with it
