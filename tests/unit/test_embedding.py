"""EmbeddingPlane with an in-process fake Triton: texts go out as one BYTES batch at the
dispatch's priority, rows come back one per text, refusals happen before dispatch."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import pytest
from qosgate.auth import TenantDirectory
from qosgate.config import parse_config
from qosgate.dataplane.embedding import EmbeddingPlane
from qosgate.errors import InvalidArgument, PermissionDenied
from qosgate.dataplane.call import Call, Header
from qosgate.upstream.pool import Route
from tritonclient.grpc import service_pb2

from tests.fakes import FakeClock, make_dataplane, make_edge

CONFIG = parse_config(
    {
        "tenants": [
            {"name": "acme", "api_keys": [{"key": "k1"}], "models": ["minilm"]},
        ]
    },
    source="<test>",
)


class FakeTriton:
    """Answers each text with the row [len(text), index]."""

    def __init__(self) -> None:
        self.requests: list[service_pb2.ModelInferRequest] = []

    async def infer(
        self, route: Route, raw_request: bytes, *, headers: Sequence[Header] = (), timeout_s: float | None = None
    ) -> service_pb2.ModelInferResponse:
        request = service_pb2.ModelInferRequest.FromString(raw_request)
        self.requests.append(request)
        route.responded()
        route.done()
        raw, texts, offset = request.raw_input_contents[0], [], 0
        while offset < len(raw):
            (size,) = struct.unpack_from("<I", raw, offset)
            texts.append(raw[offset + 4 : offset + 4 + size].decode())
            offset += 4 + size
        response = service_pb2.ModelInferResponse(model_name=request.model_name)
        response.outputs.add(name="embedding", datatype="FP32", shape=[len(texts), 2])
        response.raw_output_contents.append(
            b"".join(struct.pack("<2f", len(t), i) for i, t in enumerate(texts))
        )
        return response


@pytest.fixture
def plane_and_triton() -> tuple[EmbeddingPlane, FakeTriton, TenantDirectory]:
    dataplane = make_dataplane(CONFIG, FakeClock())
    triton = FakeTriton()
    plane = EmbeddingPlane(config=CONFIG, edge=make_edge(CONFIG, dataplane), engine=triton, clock=dataplane.clock)
    return plane, triton, dataplane.directory


def _call(model: str, priority_class: str | None = None) -> Call:
    return Call("Embed", [(b"x-api-key", b"k1")], model=model, priority_class=priority_class)


async def test_one_row_per_text_at_the_class_priority(plane_and_triton) -> None:  # type: ignore[no-untyped-def]
    plane, triton, _ = plane_and_triton
    result = await plane.embed(_call("minilm", "batch"), ["a", "bbb"])
    assert result.vectors == [[1.0, 0.0], [3.0, 1.0]]
    (request,) = triton.requests
    assert list(request.inputs[0].shape) == [2, 1] and request.inputs[0].datatype == "BYTES"
    assert request.parameters["priority"].uint64_param == CONFIG.class_level("batch")


async def test_refusals_happen_before_dispatch(plane_and_triton) -> None:  # type: ignore[no-untyped-def]
    plane, triton, _ = plane_and_triton
    with pytest.raises(PermissionDenied):
        await plane.embed(_call("smollm2"), ["a"])
    with pytest.raises(InvalidArgument):
        await plane.embed(_call("minilm"), [])
    assert triton.requests == []
