"""Writes the seed corpus of fuzz_targets/c_args.rs (its input format, in
the order the target reads it): valid calls of each operation, and the
argument defects fixed by hand (an extent between 2^63 and 2^64 bytes,
interleaved outputs). Run from fuzz/: python3 seeds/make_seeds.py"""
import struct
from pathlib import Path

F32, BF16 = 1, 2  # SYMM_DTYPE_*


def size(v):
    """size() of the target: small values, or 1 << b for powers of two."""
    if v >= 19:
        b = v.bit_length() - 1
        assert v == 1 << b, v
        return bytes([1, b])
    k = 4 + min(v, 11)
    return bytes([k, v - (k - 4)])


def tensor(shape, offset, dtype=F32, strides=None):
    ndim_byte = {1: 4, 2: 1, 3: 2, 4: 3}[len(shape)]
    out = bytes([ndim_byte, dtype - 1, 0 if strides is None else 1])
    out += b"".join(size(n) for n in shape)
    if strides is not None:
        out += b"".join(size(s) for s in strides)
    return out + bytes([2]) + struct.pack("<Q", offset)


def call(op, n, tensors, with_opts=0, dim=0, reduce=0):
    tensors = tensors + [tensor([1], 60000)] * (12 - len(tensors))
    return bytes([op, n - 1]) + b"".join(tensors) + bytes([with_opts, dim, reduce, 0, 1])


seeds = {
    "lc_allgather": call(2, 1, [tensor([2, 3], 0), tensor([2, 3], 1024)]),
    "mm_rs": call(1, 1, [tensor([4, 8], 0), tensor([8, 4], 512), tensor([4, 4], 1024)]),
    "ag_mm": call(0, 1, [tensor([4, 8], 0), tensor([4, 8], 2048), tensor([8, 4], 512), tensor([4, 4], 1024)], with_opts=2),
    "ag_mm_two_b": call(0, 2, [tensor([4, 8], 0), tensor([1], 0), tensor([8, 4], 512), tensor([8, 4], 768),
                               tensor([4, 4], 1024), tensor([4, 4], 1536)]),
    # An extent between 2^63 and 2^64 bytes: [2, 8] with a stride of 2^62.
    "huge_extent": call(2, 1, [tensor([2, 8], 0, BF16, strides=[1 << 62, 1]), tensor([2, 8], 1024, BF16)]),
    # Two outputs interleaved column by column.
    "interleaved_outs": call(0, 2, [tensor([4, 8], 0), tensor([1], 0), tensor([8, 4], 512), tensor([8, 4], 768),
                                    tensor([4, 4], 1024, strides=[8, 2]), tensor([4, 4], 1028, strides=[8, 2])]),
}
out = Path(__file__).parent / "c_args"
out.mkdir(exist_ok=True)
for name, data in seeds.items():
    (out / name).write_bytes(data)
print(f"{len(seeds)} seeds in {out}")
