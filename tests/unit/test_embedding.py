"""EmbeddingPlane with an in-process fake Triton: texts go out as one BYTES batch at the
dispatch's priority, rows come back one per text, refusals happen before dispatch."""

from __future__ import annotations

import struct

import pytest
from qosgate.auth import TenantDirectory
from qosgate.config import parse_config
from qosgate.dataplane.embedding import EmbeddingPlane
from qosgate.errors import InvalidArgument, PermissionDenied
from qosgate.upstream.engine import UpstreamObserver
from tritonclient.grpc import service_pb2

from tests.fakes import FakeClock, make_dataplane

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
        self, request: service_pb2.ModelInferRequest, timeout_s: float | None, observer: UpstreamObserver
    ) -> service_pb2.ModelInferResponse:
        self.requests.append(request)
        observer.responded()
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
    plane = EmbeddingPlane(config=CONFIG, plane=dataplane, engine=triton)
    return plane, triton, dataplane.directory


async def test_one_row_per_text_at_the_class_priority(plane_and_triton) -> None:  # type: ignore[no-untyped-def]
    plane, triton, directory = plane_and_triton
    tenant = directory.identify([("x-api-key", "k1")])
    result = await plane.embed("Embed", tenant, "minilm", ["a", "bbb"], priority_class="batch")
    assert result.vectors == [[1.0, 0.0], [3.0, 1.0]]
    (request,) = triton.requests
    assert list(request.inputs[0].shape) == [2, 1] and request.inputs[0].datatype == "BYTES"
    assert request.parameters["priority"].uint64_param == CONFIG.class_level("batch")


async def test_refusals_happen_before_dispatch(plane_and_triton) -> None:  # type: ignore[no-untyped-def]
    plane, triton, directory = plane_and_triton
    tenant = directory.identify([("x-api-key", "k1")])
    with pytest.raises(PermissionDenied):
        await plane.embed("Embed", tenant, "smollm2", ["a"])
    with pytest.raises(InvalidArgument):
        await plane.embed("Embed", tenant, "minilm", [])
    assert triton.requests == []
