"""safetensors files as views of buffers, both ways, without copying the tensors' bytes.

The service moves every request and answer body through one process, whose event loop needs Python's GIL for
each piece of a body it reads or writes. ``safetensors.torch.load`` copies each tensor of a body into a new
bytes object while it holds the GIL, and ``save`` copies each tensor twice; on a GPU host those copies held the
GIL longer than the rest of a request's handling. Here a request's tensors are views of the body it arrived in
and an answer is a header plus views of the output tensors, so only the launch's own copies to and from the GPU
move the data.

The layout is the format's: 8 bytes little-endian header length N, N bytes of JSON (per tensor: dtype, shape and
``data_offsets`` [begin, end) relative to the data, which follows the header; optional ``__metadata__``, a
string-to-string map), then the data. The reader checks what safetensors' own reader checks (the header parses,
every dtype is known, each tensor's byte range matches its shape and the ranges tile the data exactly); the
tests read this module's files with safetensors and feed it files safetensors wrote.
"""
from __future__ import annotations

import json
import math
import struct
from typing import Dict, List, Optional, Tuple, Union

import torch

# safetensors' dtype codes that torch holds
DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
          "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
          "F64": torch.float64}
CODES = {dtype: code for code, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own bound on the header


class SafetensorsFormatError(ValueError):
    """The buffer is not a safetensors file (the message says why)."""


Buffer = Union[bytes, bytearray, memoryview]


def read_header(body: Buffer) -> Tuple[Dict[str, dict], Dict[str, str], int]:
    """(tensors' entries, metadata, offset of the data) of a safetensors file, checked."""
    if len(body) < 8:
        raise SafetensorsFormatError(f"{len(body)} bytes: too short for a header")
    (n,) = struct.unpack_from("<Q", body, 0)
    if n > min(MAX_HEADER_BYTES, len(body) - 8):
        raise SafetensorsFormatError(f"header length {n} exceeds the {len(body) - 8} bytes after it")
    try:
        header = json.loads(bytes(body[8:8 + n]))
    except (UnicodeDecodeError, ValueError) as error:
        raise SafetensorsFormatError(f"the header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise SafetensorsFormatError("the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise SafetensorsFormatError("__metadata__ must map strings to strings")
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise SafetensorsFormatError(f"tensor {name!r}: its entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPES:
            raise SafetensorsFormatError(f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise SafetensorsFormatError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise SafetensorsFormatError(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise SafetensorsFormatError(f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for shape {shape} "
                                         f"of {dtype} ({nbytes} bytes)")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise SafetensorsFormatError(f"tensor {name!r} starts at byte {begin} of the data, expected {end}: "
                                         f"the tensors must tile the data")
        end = stop
    if end != len(body) - 8 - n:
        raise SafetensorsFormatError(f"the tensors hold {end} bytes of data, the file has {len(body) - 8 - n}")
    return header, metadata, 8 + n


def load_views(body: Buffer) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """(tensors, metadata) of a safetensors file; the tensors are views of ``body`` (which they keep alive).
    Give a writable buffer (a bytearray): torch warns about views of read-only memory, though nothing here or
    in the service writes to them."""
    header, metadata, start = read_header(body)
    tensors = {}
    for name, entry in header.items():
        dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
        begin, stop = entry["data_offsets"]
        try:
            if begin == stop:
                tensors[name] = torch.empty(shape, dtype=dtype)
            elif (start + begin) % dtype.itemsize:  # misaligned (no writer makes one): a copy of its own
                tensors[name] = torch.frombuffer(bytearray(body[start + begin:start + stop]), dtype=dtype).view(shape)
            else:
                tensors[name] = torch.frombuffer(body, dtype=dtype, count=(stop - begin) // dtype.itemsize,
                                                 offset=start + begin).view(shape)
        except (RuntimeError, OverflowError) as error:  # e.g. a zero-size shape with absurd other dims
            raise SafetensorsFormatError(f"tensor {name!r}: shape {shape}: {error}") from None
    return tensors, metadata


def dump_buffers(tensors: Dict[str, torch.Tensor],
                 metadata: Optional[Dict[str, str]] = None) -> List[Union[bytes, memoryview]]:
    """A safetensors file of host ``tensors`` as [header, data of each tensor]; the data buffers are views of the
    tensors' memory (each keeps its tensor alive). ``b"".join`` of them is the file: one copy."""
    header: Dict[str, object] = {}
    views: List[memoryview] = []
    offset = 0
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu" or tensor.dtype not in CODES:
            raise ValueError(f"{name}: a host tensor of {sorted(map(str, CODES))} is needed, got {tensor.dtype} on "
                             f"{tensor.device}")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        header[name] = {"dtype": CODES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + data.numel()]}
        offset += data.numel()
        views.append(memoryview(data.numpy()))
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return [struct.pack("<Q", len(text)) + text, *views]
