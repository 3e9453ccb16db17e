"""Request and response bodies <-> tensors, in the two encodings of /v1/prefill.

* ``application/json``: :class:`~server.schemas.PrefillJSONRequest` (nested lists plus a dtype field).
* ``application/octet-stream``: a safetensors file with the same tensor names; the scalars (scale,
  use_qk_l2norm_in_kernel, output_final_state) sit in its string metadata. Nothing is ever unpickled.
"""
from __future__ import annotations

import json
import struct
from typing import Dict, Optional, Tuple

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
_SCALAR_FIELDS = ("scale", "use_qk_l2norm_in_kernel", "output_final_state")


def media_type(content_type: Optional[str]) -> str:
    """The encoding a Content-Type header selects (parameters such as charset are ignored)."""
    base = (content_type or "").split(";")[0].strip().lower()
    if base in (JSON, SAFETENSORS):
        return base
    raise UnsupportedMediaType(f"Content-Type must be {JSON} or {SAFETENSORS} (a safetensors file), "
                               f"got {content_type!r}")


def decode_request(body: bytes, encoding: str) -> PrefillRequest:
    return decode_json(body) if encoding == JSON else decode_safetensors(body)


def encode_result(result: PrefillResult, encoding: str) -> bytes:
    return encode_json(result) if encoding == JSON else encode_safetensors(result)


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
    return prepare_request(tensors, parsed.scale, parsed.use_qk_l2norm_in_kernel, parsed.output_final_state)


def _tensor_from_lists(name: str, data, dtype: torch.dtype) -> torch.Tensor:
    try:
        return torch.tensor(data, dtype=dtype)
    except (ValueError, TypeError, RuntimeError) as error:  # ragged nesting, out-of-range integers
        raise InputError(name, f"{name} is not a rectangular array: {error}") from error


def encode_json(result: PrefillResult) -> bytes:
    payload = {"dtype": DTYPE_NAMES.get(result.o.dtype, str(result.o.dtype)), "o": result.o.tolist(),
               "final_state": None if result.final_state is None else result.final_state.tolist()}
    return json.dumps(payload, allow_nan=True).encode()


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
    final = _parse_bool("output_final_state", metadata.get("output_final_state"), True)
    return prepare_request(tensors, scale, l2norm, final)


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


def _parse_bool(name: str, text: Optional[str], default: bool) -> bool:
    if text is None:
        return default
    word = text.strip().lower()
    if word in ("1", "true", "yes"):
        return True
    if word in ("0", "false", "no"):
        return False
    raise InputError(name, f"{name} must be 'true' or 'false', got {text!r}")


def encode_safetensors(result: PrefillResult) -> bytes:
    tensors = {"o": result.o.contiguous()}
    if result.final_state is not None:
        tensors["final_state"] = result.final_state.contiguous()
    return save_safetensors(tensors)


def encode_safetensors_request(tensors: Dict[str, torch.Tensor], scale: Optional[float] = None,
                               use_qk_l2norm_in_kernel: bool = False, output_final_state: bool = True) -> bytes:
    """Client helper: a /v1/prefill safetensors body (used by tests and scripts/service_bench.py)."""
    metadata = {"use_qk_l2norm_in_kernel": str(use_qk_l2norm_in_kernel).lower(),
                "output_final_state": str(output_final_state).lower()}
    if scale is not None:
        metadata["scale"] = repr(float(scale))
    return save_safetensors({n: t.contiguous() for n, t in tensors.items() if t is not None}, metadata=metadata)


def decode_safetensors_response(body: bytes) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Client helper: (o, final_state) from a safetensors /v1/prefill answer."""
    tensors = load_safetensors(body)
    return tensors["o"], tensors.get("final_state")
