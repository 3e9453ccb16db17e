"""Request and response bodies <-> tensors, in the two encodings of /v1/prefill.

* ``application/json``: :class:`~server.schemas.PrefillJSONRequest` (nested lists plus a dtype field).
* ``application/octet-stream``: a safetensors file with the same tensor names; the scalars (scale,
  use_qk_l2norm_in_kernel, output_final_state) sit in its string metadata. Nothing is ever unpickled. A
  request's tensors are views of its body and an answer is built from views of the outputs
  (server.safetensors_views).
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional, Tuple, Union

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from .errors import InputError, UnsupportedMediaType
from .prefill import PrefillRequest, PrefillResult, prepare_request, state_dtype
from .safetensors_views import SafetensorsFormatError, dump_buffers, load_views, read_header
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


def decode_request(body: Union[bytes, bytearray], encoding: str) -> PrefillRequest:
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

def decode_safetensors(body: Union[bytes, bytearray]) -> PrefillRequest:
    """The request's tensors are views of ``body`` (give a bytearray: see load_views)."""
    try:
        tensors, metadata = load_views(body)
    except SafetensorsFormatError as error:
        raise InputError("body", f"the body is not a valid safetensors file: {error}") from error
    unknown = sorted(set(metadata) - set(_SCALAR_FIELDS))
    if unknown:
        raise InputError(unknown[0], f"unknown metadata key {unknown[0]!r}; expected {list(_SCALAR_FIELDS)}")
    scale = _parse_float("scale", metadata.get("scale"))
    l2norm = _parse_bool("use_qk_l2norm_in_kernel", metadata.get("use_qk_l2norm_in_kernel"), False)
    final = _parse_bool("output_final_state", metadata.get("output_final_state"), None)
    session_ids = _parse_session_ids(metadata.get("session_ids"))
    return prepare_request(tensors, scale, l2norm, final, session_ids)




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
    """The answer as a safetensors file in buffers: its header, then views of o [and final_state]
    (server.safetensors_views.dump_buffers); ``b"".join`` of them is the file."""
    tensors = {"o": result.o}
    if result.final_state is not None:
        tensors["final_state"] = result.final_state
    metadata = None if result.session_tokens is None else {"session_tokens": json.dumps(result.session_tokens)}
    return dump_buffers(tensors, metadata)


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
    return read_header(body)[1]
