"""At load, a GGUF import's Q4_0, Q4_1 and Q5_0 layers are repacked in place into the 8-row
tiles that the decode kernel reads fastest (kernels/gguf_packed.py says why and how).

Only the blocks' dense projections are repacked: attention's QKV and output, a dense MLP's up
and down. The token embedding (looked up a row at a time, and read by a tied head), an untied
head and the experts of a mixture keep the file's rows. Each variable takes the packed bytes
of the same size, so memory does not grow, and its Dense layer's part type becomes the
packed one ("q4_1" -> "q4_1x8"), which every reader of the weights (the step's ops, a full
forward pass, the pure-TF dequantize path) passes on. Nothing is written back: an export
holds the file's rows, and a model repacked for an engine refuses to be exported
(packed_layers; export it before serving it, or load it again).

TOKENSERVE_GGUF_REPACK=off keeps the file's rows (llama.cpp's --no-repack), for comparisons.
"""

from __future__ import annotations

import logging
import os

from tokenserve.kernels.gguf_matmul import reads_packed_faster
from tokenserve.kernels.gguf_packed import PACKABLE, PACKED, TILE_ROWS, pack_rows
from tokenserve.model.layers import MLP, Dense

log = logging.getLogger(__name__)


def _projections(model):
    """(name, Dense) of each block's dense projections."""
    for i, block in enumerate(getattr(model, "blocks", ())):
        yield f"block_{i}/qkv", block.attn.qkv
        yield f"block_{i}/out", block.attn.out
        if isinstance(block.mlp, MLP):
            yield f"block_{i}/up", block.mlp.up
            yield f"block_{i}/down", block.mlp.down


REPACK_ENV = "TOKENSERVE_GGUF_REPACK"


def packed_layers(model) -> list[str]:
    """The layers of `model` that hold repacked tiles ("block_0/qkv", ...)."""
    return [name for name, layer in _projections(model)
            if any(t in PACKED for t in getattr(layer, "block_types", None) or ())]


def pack_for_decode(model) -> int:
    """Repacks `model`'s packable GGUF parts in place where the compiled kernels read tiles
    faster (gguf_matmul.reads_packed_faster) and REPACK_ENV is not "off"; returns how many
    bytes were repacked. A part is packable when its type has a packed form and its rows make
    whole tiles."""
    if os.environ.get(REPACK_ENV, "").lower() == "off" or not reads_packed_faster():
        return 0
    packed_bytes = 0
    for _, layer in _projections(model):
        if not isinstance(layer, Dense) or not getattr(layer, "block_types", None):
            continue
        for i, (name, variable) in enumerate(zip(layer.block_types, layer.kernel_blocks)):
            if name not in PACKABLE or variable.shape[0] % TILE_ROWS:
                continue
            variable.assign(pack_rows(variable.numpy(), name))
            layer.block_types[i] = PACKABLE[name]
            packed_bytes += variable.shape[0] * variable.shape[1]
    if packed_bytes:
        log.info("GGUF blocks: %.1f MiB of Q4_0/Q4_1/Q5_0 rows repacked into %d-row tiles for "
                 "the decode kernel (in place; the export keeps the file's rows)",
                 packed_bytes / 2**20, TILE_ROWS)
    return packed_bytes
