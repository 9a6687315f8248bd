"""KServe v2 tensor bytes for the few shapes generation contracts use.

Adapters build ModelInferRequest protos (plain protobuf from tritonclient, no gRPC) with
every input in `raw_input_contents`: Triton requires raw contents for all inputs once one
input uses them, and raw bytes avoid a per-element proto field. Responses are read back
from `raw_output_contents` (what Triton sends) or the typed `contents` (what other KServe
servers may send).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TypeAlias

from tritonclient.grpc import service_pb2

from qosgate.errors import Internal

# datatype -> (the struct of one element, typed-contents field name)
_NUMERIC = {
    "BOOL": (struct.Struct("?"), "bool_contents"),
    "INT32": (struct.Struct("<i"), "int_contents"),
    "INT64": (struct.Struct("<q"), "int64_contents"),
    "UINT32": (struct.Struct("<I"), "uint_contents"),
    "UINT64": (struct.Struct("<Q"), "uint64_contents"),
    "FP32": (struct.Struct("<f"), "fp32_contents"),
}
# A BYTES element's length, before its bytes.
_LENGTH = struct.Struct("<I")


class TensorWriter:
    """Appends named inputs to one ModelInferRequest, all as raw contents."""

    __slots__ = ("_request",)

    def __init__(self, request: service_pb2.ModelInferRequest) -> None:
        self._request = request

    def _add(self, name: str, datatype: str, shape: Sequence[int], raw: bytes) -> None:
        tensor = self._request.inputs.add()
        tensor.name = name
        tensor.datatype = datatype
        tensor.shape.extend(shape)
        self._request.raw_input_contents.append(raw)

    def strings(self, name: str, values: Sequence[str], shape: Sequence[int]) -> None:
        # BYTES elements travel as a 4-byte little-endian length followed by the bytes.
        parts = []
        for value in values:
            data = value.encode("utf-8")
            parts.append(_LENGTH.pack(len(data)))
            parts.append(data)
        self._add(name, "BYTES", shape, b"".join(parts))

    def scalar(self, name: str, datatype: str, value: bool | int | float, shape: Sequence[int]) -> None:
        fmt, _ = _NUMERIC[datatype]
        self._add(name, datatype, shape, fmt.pack(value))


Tensor: TypeAlias = service_pb2.ModelInferResponse.InferOutputTensor | service_pb2.ModelInferRequest.InferInputTensor


class TensorReader:
    """Named outputs of one ModelInferResponse (or inputs of one ModelInferRequest);
    absent tensors read as None.

    The message's repeated fields are read once, here: a streamed generation reads a
    handful of outputs from every token's response, and each access to a protobuf
    repeated field costs more than the value it gives."""

    __slots__ = ("_tensors",)

    def __init__(self, message: service_pb2.ModelInferResponse | service_pb2.ModelInferRequest) -> None:
        tensors: Sequence[Tensor]
        if isinstance(message, service_pb2.ModelInferRequest):
            tensors, raw = message.inputs, list(message.raw_input_contents)
        else:
            tensors, raw = message.outputs, list(message.raw_output_contents)
        self._tensors: dict[str, tuple[Tensor, bytes | None]] = {
            t.name: (t, raw[i] if i < len(raw) else None) for i, t in enumerate(tensors)
        }

    def strings(self, name: str, *, limit: int | None = None) -> list[str] | None:
        """The output's elements (the first `limit` of them, if given)."""
        found = self._tensors.get(name)
        if found is None:
            return None
        tensor, raw = found
        if raw is None:
            return [b.decode("utf-8", errors="replace") for b in tensor.contents.bytes_contents[:limit]]
        values: list[str] = []
        offset, end = 0, len(raw)
        while offset < end and (limit is None or len(values) < limit):
            if offset + 4 > end:
                raise Internal(f"tensor {name!r}: truncated BYTES element")
            (size,) = _LENGTH.unpack_from(raw, offset)
            offset += 4
            values.append(raw[offset : offset + size].decode("utf-8", errors="replace"))
            offset += size
        return values

    def numbers(self, name: str) -> list[int | float | bool] | None:
        found = self._tensors.get(name)
        if found is None:
            return None
        tensor, raw = found
        if tensor.datatype not in _NUMERIC:
            raise Internal(f"tensor {name!r}: unexpected datatype {tensor.datatype}")
        fmt, field = _NUMERIC[tensor.datatype]
        if raw is None:
            return list(getattr(tensor.contents, field))
        whole = len(raw) - len(raw) % fmt.size
        return [value for (value,) in fmt.iter_unpack(raw[:whole])]

    def first_string(self, name: str) -> str | None:
        values = self.strings(name, limit=1)
        return values[0] if values else None

    def first_int(self, name: str) -> int | None:
        values = self.numbers(name)
        return int(values[0]) if values else None


def stream_request(model: str, request_id: str) -> service_pb2.ModelInferRequest:
    """A request for ModelStreamInfer that asks Triton to mark the last response.

    With `triton_enable_empty_final_response`, every request's last response carries the
    parameter `triton_final_response` (empty when the model sent the FINAL flag alone), so
    a reader knows where one request ends without knowing the model.
    """
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


def is_final(response: service_pb2.ModelInferResponse) -> bool:
    param = response.parameters.get("triton_final_response")
    return bool(param is not None and param.bool_param)
