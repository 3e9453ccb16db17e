"""Request and response bodies <-> tensors, in the two encodings of /v1/prefill.

* ``application/json``: :class:`~server.schemas.PrefillJSONRequest` (nested lists plus a dtype field).
* ``application/octet-stream``: a safetensors file with the same tensor names; the scalars (scale,
  use_qk_l2norm_in_kernel, output_final_state) sit in its string metadata. Nothing is ever unpickled. An answer
  is sent as buffers (:func:`safetensors_buffers`): its header, then the output tensors' own bytes, uncopied.
"""
from __future__ import annotations

import json
import struct
from typing import Dict, List, Optional, Tuple, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from .errors import InputError, UnsupportedMediaType
from .prefill import PrefillRequest, PrefillResult, prepare_request, state_dtype
from .schemas import PrefillJSONRequest

JSON = "application/json"
SAFETENSORS = "application/octet-stream"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}
_SCALAR_FIELDS = ("scale", "use_qk_l2norm_in_kernel", "output_final_state", "session_ids")


def media_type(content_type: Optional[str]) -> str:
    """The encoding a Content-Type header selects (parameters such as charset are ignored)."""
    base = (content_type or "").split(";")[0].strip().lower()
    if base in (JSON, SAFETENSORS):
        return base
    raise UnsupportedMediaType(f"Content-Type must be {JSON} or {SAFETENSORS} (a safetensors file), "
                               f"got {content_type!r}")


def decode_request(body: bytes, encoding: str) -> PrefillRequest:
    return decode_json(body) if encoding == JSON else decode_safetensors(body)


# -- JSON -------------------------------------------------------------------------------------------------------

def decode_json(body: bytes) -> PrefillRequest:
    # pydantic raises ValidationError with the failing field's location; the caller turns it into 422.
    parsed = PrefillJSONRequest.model_validate_json(body)
    qkv_dtype = DTYPES[parsed.dtype]
    aux_dtype = state_dtype(qkv_dtype)  # g, beta and the state: float32, or float64 for float64 requests
    tensors = {name: _tensor_from_lists(name, getattr(parsed, name), qkv_dtype) for name in ("q", "k", "v")}
    tensors.update({name: _tensor_from_lists(name, getattr(parsed, name), aux_dtype) for name in ("g", "beta")})
    tensors["cu_seqlens"] = _tensor_from_lists("cu_seqlens", parsed.cu_seqlens, torch.int64)
    if parsed.initial_state is not None:
        tensors["initial_state"] = _tensor_from_lists("initial_state", parsed.initial_state, aux_dtype)
    return prepare_request(tensors, parsed.scale, parsed.use_qk_l2norm_in_kernel, parsed.output_final_state,
                           parsed.session_ids)


def _tensor_from_lists(name: str, data, dtype: torch.dtype) -> torch.Tensor:
    try:
        tensor = torch.tensor(data, dtype=dtype)
    except (ValueError, TypeError, RuntimeError) as error:  # ragged nesting, out-of-range integers
        raise InputError(name, f"{name} is not a rectangular array: {error}") from error
    # pydantic refused NaN / Infinity / 1e400; a finite number can still overflow the narrower dtype
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise InputError(name, f"{name} holds a number outside the range of {DTYPE_NAMES[dtype]}")
    return tensor


def encode_json(result: PrefillResult) -> bytes:
    """Strict JSON (no NaN / Infinity tokens, which standard parsers reject): a non-finite output, which only
    overflowing inputs produce, is a 422 telling the client to use safetensors."""
    for name, tensor in (("o", result.o), ("final_state", result.final_state)):
        if tensor is not None and not bool(torch.isfinite(tensor).all()):
            raise InputError("body", f"the result's {name} holds non-finite values (the inputs overflow "
                                     f"{DTYPE_NAMES.get(tensor.dtype, tensor.dtype)}); JSON cannot carry them, "
                                     f"safetensors (application/octet-stream) can")
    payload = {"dtype": DTYPE_NAMES.get(result.o.dtype, str(result.o.dtype)), "o": result.o.tolist(),
               "final_state": None if result.final_state is None else result.final_state.tolist(),
               "session_tokens": result.session_tokens}
    return json.dumps(payload, allow_nan=False).encode()


# -- safetensors ------------------------------------------------------------------------------------------------

def decode_safetensors(body: bytes) -> PrefillRequest:
    try:
        tensors = load_safetensors(body)
        metadata = _safetensors_metadata(body)
    except (SafetensorError, ValueError, struct.error) as error:
        raise InputError("body", f"the body is not a valid safetensors file: {error}") from error
    unknown = sorted(set(metadata) - set(_SCALAR_FIELDS))
    if unknown:
        raise InputError(unknown[0], f"unknown metadata key {unknown[0]!r}; expected {list(_SCALAR_FIELDS)}")
    scale = _parse_float("scale", metadata.get("scale"))
    l2norm = _parse_bool("use_qk_l2norm_in_kernel", metadata.get("use_qk_l2norm_in_kernel"), False)
    final = _parse_bool("output_final_state", metadata.get("output_final_state"), None)
    session_ids = _parse_session_ids(metadata.get("session_ids"))
    return prepare_request(tensors, scale, l2norm, final, session_ids)


def _safetensors_metadata(body: bytes) -> Dict[str, str]:
    """The header's ``__metadata__``. safetensors exposes metadata only through ``safe_open`` on a file path;
    the header is an 8-byte little-endian length then JSON, which load() above has already validated."""
    (header_len,) = struct.unpack_from("<Q", body, 0)
    header = json.loads(body[8:8 + header_len])
    return dict(header.get("__metadata__") or {})


def _parse_float(name: str, text: Optional[str]) -> Optional[float]:
    if text is None or text.strip().lower() in ("", "none", "null"):
        return None
    try:
        return float(text)
    except ValueError as error:
        raise InputError(name, f"{name} must be a float, got {text!r}") from error


def _parse_session_ids(text: Optional[str]) -> Optional[List[str]]:
    if text is None:
        return None
    try:
        ids = json.loads(text)
    except ValueError:
        ids = None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise InputError("session_ids", f"session_ids must be a JSON list of strings, got {text[:80]!r}")
    return ids


def _parse_bool(name: str, text: Optional[str], default: Optional[bool]) -> Optional[bool]:
    if text is None:
        return default
    word = text.strip().lower()
    if word in ("1", "true", "yes"):
        return True
    if word in ("0", "false", "no"):
        return False
    raise InputError(name, f"{name} must be 'true' or 'false', got {text!r}")


def encode_safetensors(result: PrefillResult) -> List[Union[bytes, memoryview]]:
    """The answer as a safetensors file in buffers (see safetensors_buffers); ``b"".join`` of them is the file."""
    tensors = {"o": result.o}
    if result.final_state is not None:
        tensors["final_state"] = result.final_state
    metadata = None if result.session_tokens is None else {"session_tokens": json.dumps(result.session_tokens)}
    return safetensors_buffers(tensors, metadata)


_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def safetensors_buffers(tensors: Dict[str, torch.Tensor],
                        metadata: Optional[Dict[str, str]] = None) -> List[Union[bytes, memoryview]]:
    """A safetensors file of host ``tensors`` as [header, data of each tensor]: the data buffers are views of the
    tensors' memory (each keeps its tensor alive), so the file costs one copy, by whoever joins the buffers
    (``bytes.join`` lets go of the GIL while it copies a megabyte or more). ``safetensors.torch.save`` copies
    every tensor twice. The header is the format's layout: its length as 8 little-endian bytes, then JSON (dtype,
    shape and byte range of each tensor, string metadata) padded with spaces to a multiple of 8; the tests read
    answers back with safetensors' own reader."""
    header: Dict[str, object] = {}
    views: List[memoryview] = []
    offset = 0
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu" or tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: a host tensor of {sorted(map(str, _SAFETENSORS_DTYPES))} is needed, got "
                             f"{tensor.dtype} on {tensor.device}")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + data.numel()]}
        offset += data.numel()
        views.append(memoryview(data.numpy()))
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [struct.pack("<Q", len(text)) + text, *views]


def encode_safetensors_request(tensors: Dict[str, torch.Tensor], scale: Optional[float] = None,
                               use_qk_l2norm_in_kernel: bool = False, output_final_state: Optional[bool] = None,
                               session_ids: Optional[List[str]] = None) -> bytes:
    """Client helper: a /v1/prefill safetensors body. ``output_final_state=None`` leaves it to the server
    (final states come back unless the request continues sessions)."""
    metadata = {"use_qk_l2norm_in_kernel": str(use_qk_l2norm_in_kernel).lower()}
    if output_final_state is not None:
        metadata["output_final_state"] = str(output_final_state).lower()
    if scale is not None:
        metadata["scale"] = repr(float(scale))
    if session_ids is not None:
        metadata["session_ids"] = json.dumps(list(session_ids))
    return save_safetensors({n: t.contiguous() for n, t in tensors.items() if t is not None}, metadata=metadata)


def decode_safetensors_response(body: bytes) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Client helper: (o, final_state) from a safetensors /v1/prefill answer."""
    tensors = load_safetensors(body)
    return tensors["o"], tensors.get("final_state")


def safetensors_metadata(body: bytes) -> Dict[str, str]:
    """Client helper: the string metadata of a safetensors body (e.g. an answer's session_tokens)."""
    return _safetensors_metadata(body)
