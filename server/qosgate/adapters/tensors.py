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

from tritonclient.grpc import service_pb2

from qosgate.errors import Internal

# datatype -> (struct format of one element, typed-contents field name)
_NUMERIC = {
    "BOOL": ("?", "bool_contents"),
    "INT32": ("<i", "int_contents"),
    "INT64": ("<q", "int64_contents"),
    "UINT32": ("<I", "uint_contents"),
    "UINT64": ("<Q", "uint64_contents"),
    "FP32": ("<f", "fp32_contents"),
}


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
            parts.append(struct.pack("<I", len(data)))
            parts.append(data)
        self._add(name, "BYTES", shape, b"".join(parts))

    def scalar(self, name: str, datatype: str, value: bool | int | float, shape: Sequence[int]) -> None:
        fmt, _ = _NUMERIC[datatype]
        self._add(name, datatype, shape, struct.pack(fmt, value))


class TensorReader:
    """Named outputs of one ModelInferResponse; absent outputs read as None."""

    __slots__ = ("_response", "_index")

    def __init__(self, response: service_pb2.ModelInferResponse) -> None:
        self._response = response
        self._index = {t.name: i for i, t in enumerate(response.outputs)}

    def _raw(self, index: int) -> bytes | None:
        raw = self._response.raw_output_contents
        return raw[index] if index < len(raw) else None

    def strings(self, name: str) -> list[str] | None:
        index = self._index.get(name)
        if index is None:
            return None
        raw = self._raw(index)
        if raw is None:
            return [b.decode("utf-8", errors="replace") for b in self._response.outputs[index].contents.bytes_contents]
        values, offset = [], 0
        while offset < len(raw):
            if offset + 4 > len(raw):
                raise Internal(f"output {name!r}: truncated BYTES element")
            (size,) = struct.unpack_from("<I", raw, offset)
            offset += 4
            values.append(raw[offset : offset + size].decode("utf-8", errors="replace"))
            offset += size
        return values

    def numbers(self, name: str) -> list[int | float | bool] | None:
        index = self._index.get(name)
        if index is None:
            return None
        tensor = self._response.outputs[index]
        if tensor.datatype not in _NUMERIC:
            raise Internal(f"output {name!r}: unexpected datatype {tensor.datatype}")
        fmt, field = _NUMERIC[tensor.datatype]
        raw = self._raw(index)
        if raw is None:
            return list(getattr(tensor.contents, field))
        size = struct.calcsize(fmt)
        return [struct.unpack_from(fmt, raw, i)[0] for i in range(0, len(raw) - size + 1, size)]

    def first_string(self, name: str) -> str | None:
        values = self.strings(name)
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
