"""Reading a GGUF file with the `gguf` package: its metadata as plain Python values, and its
tensors dequantized to float32 one at a time. What the importer (gguf.py) and the tokenizer
rebuild (gguf_tokenizer.py) both read; it imports neither of them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from tokenserve.errors import ModelLoadError, ModelNotFoundError, UnsupportedGGUFError

__all__ = ["GGUFFile", "UnsupportedGGUFError", "dequantize", "read_gguf",
           "supported_tensor_types"]


@dataclasses.dataclass
class GGUFFile:
    """A GGUF file's metadata (plain Python values) and its tensors (not yet read)."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf.ReaderTensor

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "<none>"))

    def get(self, key: str, default=None):
        """`{architecture}.key` (e.g. `block_count`), or `default`."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path.name} has no {self.architecture}.{key}")
        return value


def read_gguf(path: str | Path) -> GGUFFile:
    """Opens a GGUF file (memory-mapped): metadata now, tensors when `dequantize`d."""
    try:
        import gguf
    except ImportError:  # pragma: no cover - a dependency of tokenserve
        raise ModelLoadError("reading GGUF files needs the `gguf` package: "
                             "pip install gguf") from None
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as error:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {error}") from error
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            metadata[key] = field.contents()
        except Exception:  # noqa: BLE001  a value we cannot decode is one we do not need
            metadata[key] = None
    return GGUFFile(path, metadata, {t.name: t for t in reader.tensors})


def dequantize(tensor) -> np.ndarray:
    """A tensor of the file as float32, in NumPy (row-major, torch-like [out, in]) order."""
    import gguf

    try:
        value = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise UnsupportedGGUFError(
            f"tensor {tensor.name} has type {tensor.tensor_type.name}, which tokenserve cannot "
            f"dequantize; supported: {', '.join(supported_tensor_types())}") from None
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the innermost first
    return np.asarray(value, np.float32).reshape(shape)


def supported_tensor_types() -> list[str]:
    """The GGML tensor types that `dequantize` reads, by name."""
    import gguf

    traits = getattr(gguf.quants, "_type_traits", {})
    names = ["F32", "F16"] + [t.name for t in gguf.GGMLQuantizationType if t in traits]
    return list(dict.fromkeys(names))
