#!/usr/bin/env python3
"""Writes crates/frugal/src/quant/testdata/gguf-py-blocks.bin: random but valid blocks of the
K-quant and IQ4 formats with the values gguf-py (llama.cpp's Python package) decodes them to,
an oracle for frugal's decoders that shares no code with them.

    python3 -m venv /tmp/ggufpy && /tmp/ggufpy/bin/pip install gguf numpy
    /tmp/ggufpy/bin/python scripts/gen-quant-fixtures.py

Deterministic (fixed seed); the output is committed, so tests never need this script.

File layout (little-endian): b"FQFX", u32 record count; per record u32 GGML type id, u32
element count, u32 byte count, the block bytes, then the f32 values.
"""

import pathlib
import struct

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

# type: (blocks, byte offsets of its f16 scales)
TYPES = {
    T.Q2_K: (2, [80, 82]),
    T.Q3_K: (2, [108]),
    T.Q5_K: (2, [0, 2]),
    T.IQ4_NL: (8, [0]),
    T.IQ4_XS: (2, [0]),
    # Formats frugal already had, one block each, for the same independent check.
    T.Q4_K: (1, [0, 2]),
    T.Q6_K: (1, [208]),
}
BLOCK = {T.Q2_K: (256, 84), T.Q3_K: (256, 110), T.Q5_K: (256, 176), T.IQ4_NL: (32, 18),
         T.IQ4_XS: (256, 136), T.Q4_K: (256, 144), T.Q6_K: (256, 210)}


def scale(rng, i):
    """A finite, modest f16: both signs, magnitudes 2^-12..2^2, and exactly 0 now and then."""
    if i % 7 == 6:
        return np.float16(0.0)
    mag = 2.0 ** rng.uniform(-12, 2)
    return np.float16(mag if rng.random() < 0.7 else -mag)


def main():
    rng = np.random.default_rng(20240917)
    out = bytearray(b"FQFX")
    out += struct.pack("<I", len(TYPES))
    for ty, (nblocks, offsets) in TYPES.items():
        n, nbytes = BLOCK[ty]
        data = rng.integers(0, 256, size=(nblocks, nbytes), dtype=np.uint8)
        k = 0
        for b in range(nblocks):
            for o in offsets:
                data[b, o:o + 2] = np.frombuffer(scale(rng, k).tobytes(), dtype=np.uint8)
                k += 1
        values = dequantize(data, ty).astype("<f4").reshape(-1)
        assert values.size == nblocks * n and np.all(np.isfinite(values))
        out += struct.pack("<III", int(ty), values.size, data.size)
        out += data.tobytes()
        out += values.tobytes()
    path = pathlib.Path(__file__).resolve().parent.parent / "crates/frugal/src/quant/testdata"
    path.mkdir(parents=True, exist_ok=True)
    (path / "gguf-py-blocks.bin").write_bytes(bytes(out))
    print(f"wrote {len(out)} bytes to {path / 'gguf-py-blocks.bin'}")


if __name__ == "__main__":
    main()
