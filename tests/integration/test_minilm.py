"""The minilm embedding model and the identity model on a real tritonserver.

Run with QOSGATE_TEST_MODELS=minilm,identity to leave the LLM out while developing.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import require_model

pytestmark = pytest.mark.integration

EMBEDDING_DIM = 384


@pytest.fixture(scope="module")
def client(triton) -> grpcclient.InferenceServerClient:
    with grpcclient.InferenceServerClient(triton.ports.grpc_url) as c:
        yield c


def tensor(name: str, datatype: str, value: np.ndarray) -> grpcclient.InferInput:
    result = grpcclient.InferInput(name, list(value.shape), datatype)
    result.set_data_from_numpy(value)
    return result


def text_input(texts: list[str]) -> grpcclient.InferInput:
    return tensor("text", "BYTES", np.array([[t.encode()] for t in texts], dtype=np.object_))


def embed(client: grpcclient.InferenceServerClient, texts: list[str], **kwargs) -> np.ndarray:
    result = client.infer("minilm", [text_input(texts)], **kwargs)
    return result.as_numpy("embedding")


def test_embeddings_are_384_dimensional_unit_vectors(client) -> None:
    require_model("minilm")
    vectors = embed(client, ["The cat sits on the mat.", "GPUs are fast.", "Bonjour"])
    assert vectors.shape == (3, EMBEDDING_DIM)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    # Different texts, different vectors: a model that returned a constant would pass the
    # norm check alone.
    assert not np.allclose(vectors[0], vectors[1])


def test_paraphrase_is_closer_than_an_unrelated_sentence(client) -> None:
    require_model("minilm")
    anchor, paraphrase, unrelated = embed(
        client,
        [
            "How do I reset my password?",
            "What are the steps to change a forgotten password?",
            "The recipe needs two cups of flour and an egg.",
        ],
    )
    # Unit vectors: the dot product is the cosine similarity.
    similar, different = float(anchor @ paraphrase), float(anchor @ unrelated)
    assert similar > 0.5, similar
    assert similar > different + 0.3, (similar, different)


def test_same_text_embeds_the_same_alone_or_in_a_batch(client) -> None:
    require_model("minilm")
    alone = embed(client, ["Padding must not change the vector."])[0]
    batched = embed(client, ["x", "Padding must not change the vector.", "a much longer " * 20])[1]
    np.testing.assert_allclose(alone, batched, atol=1e-4)


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_every_gateway_class_level_is_served(client, level: int) -> None:
    require_model("minilm")
    vectors = embed(client, ["priority check"], priority=level, timeout=30_000_000)
    assert vectors.shape == (1, EMBEDDING_DIM)


def test_concurrent_requests_are_batched(client) -> None:
    require_model("minilm")
    requests, concurrency = 96, 16
    before = minilm_statistics(client)
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        shapes = list(
            pool.map(lambda i: embed(client, [f"sentence number {i}"]).shape, range(requests))
        )
    assert shapes == [(1, EMBEDDING_DIM)] * requests
    # Triton counts a request after its response is sent: the last few may not be counted
    # yet when the client has them all (seen on a fast machine: 88 of 96).
    deadline = time.monotonic() + 10
    after = minilm_statistics(client)
    while after.inference_count - before.inference_count < requests and time.monotonic() < deadline:
        time.sleep(0.05)
        after = minilm_statistics(client)

    inferences = after.inference_count - before.inference_count
    executions = after.execution_count - before.execution_count
    # >=: the previous test's last request may be counted after its response arrived.
    assert inferences >= requests
    # Fewer model executions than inferences means the dynamic batcher merged requests.
    assert executions < inferences, (executions, inferences)


@dataclass(slots=True)
class Burst:
    """Requests fired at once with async_infer; outcomes kept in completion order."""

    client: grpcclient.InferenceServerClient
    outcomes: list[tuple[str, str]] = field(default_factory=list)  # (tag, "ok" or status)
    expected: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _all_done: threading.Event = field(default_factory=threading.Event)

    def fire(self, tag: str, count: int, texts: int = 1, words: int = 2, **kwargs) -> None:
        """Fire `count` requests, each with `texts` texts of about `words` words."""
        self.expected += count
        for i in range(count):
            batch = [f"{tag} text {i} " + "lorem " * words for _ in range(texts)]
            self.client.async_infer("minilm", [text_input(batch)], self._record(tag), **kwargs)

    def _record(self, tag: str):
        def callback(result, error) -> None:
            with self._lock:
                self.outcomes.append((tag, "ok" if error is None else error.status()))
                if len(self.outcomes) == self.expected:
                    self._all_done.set()

        return callback

    def wait(self, timeout: float = 120.0) -> list[tuple[str, str]]:
        assert self._all_done.wait(timeout), f"{len(self.outcomes)}/{self.expected} answered"
        return self.outcomes


def test_a_higher_priority_level_overtakes_a_queued_lower_one(client) -> None:
    require_model("minilm")
    load = Burst(client)
    # Each batch request fills a quarter of max_batch_size with long texts, so one execution
    # takes four of them and is slow: the 64 cannot drain while they are being sent, and most
    # are still queued when the critical requests arrive, however fast the machine is.
    load.fire("batch", 64, texts=8, words=20, priority=4)
    load.fire("critical", 4, priority=1)
    outcomes = load.wait()
    assert all(status == "ok" for _, status in outcomes)
    last_critical = max(rank for rank, (tag, _) in enumerate(outcomes) if tag == "critical")
    # First come, first served would answer every earlier batch request first. By
    # priority, the batch requests still queued when the critical ones arrived finish
    # after them.
    overtaken = sum(1 for tag, _ in outcomes[last_critical + 1 :] if tag == "batch")
    assert overtaken >= 32, outcomes


def test_a_full_level_queue_rejects_at_once(client) -> None:
    require_model("minilm")
    load = Burst(client)
    # Slow executions (as above), so the burst outruns the queue at any machine speed.
    load.fire("critical", 200, texts=8, words=20, priority=1)  # level 1 queues at most 64
    statuses = [status for _, status in load.wait()]
    assert "ok" in statuses
    assert set(statuses) == {"ok", "StatusCode.UNAVAILABLE"}, statuses
    # Unbounded, all 200 would queue and be served. Bounded at 64, with only a few requests
    # served while the burst arrives, most of the other 136 are refused.
    assert statuses.count("StatusCode.UNAVAILABLE") >= 100, statuses


def test_a_request_timeout_expires_in_the_queue(client) -> None:
    require_model("minilm")
    load = Burst(client)
    # Slow executions (as above), so the backlog is still queued when the impatient requests
    # arrive however fast the machine is: small ones drained as they were sent on a fast one.
    load.fire("backlog", 64, texts=8, words=20, priority=4)
    load.fire("impatient", 4, priority=4, timeout=1000)  # 1 ms, overriding the level's 120 s
    outcomes = load.wait()
    assert {status for tag, status in outcomes if tag == "impatient"} == {"StatusCode.UNAVAILABLE"}
    assert {status for tag, status in outcomes if tag == "backlog"} == {"ok"}


def minilm_statistics(client: grpcclient.InferenceServerClient):
    stats = client.get_inference_statistics("minilm", as_json=False)
    (model,) = stats.model_stats
    return model


MALFORMED = {
    "wrong dtype": (
        [tensor("text", "INT32", np.array([[7]], dtype=np.int32))],
        "expects 'BYTES'",
    ),
    "unknown input": (
        [tensor("txt", "BYTES", np.array([[b"hello"]], dtype=np.object_))],
        "unexpected inference input 'txt'",
    ),
    "missing input": ([], "expected 1 inputs but got 0"),
    "blank text": ([text_input(["fine", "   "])], "text[1] is empty"),
    "invalid UTF-8": (
        [tensor("text", "BYTES", np.array([[b"\xff\xfe"]], dtype=np.object_))],
        "not valid UTF-8",
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_request_is_invalid_argument_and_the_model_keeps_serving(
    client, case: str
) -> None:
    require_model("minilm")
    inputs, message = MALFORMED[case]
    with pytest.raises(InferenceServerException) as excinfo:
        client.infer("minilm", inputs)
    assert excinfo.value.status() == "StatusCode.INVALID_ARGUMENT", excinfo.value
    assert message in excinfo.value.message(), excinfo.value.message()

    assert embed(client, ["still serving"]).shape == (1, EMBEDDING_DIM)
    assert client.is_model_ready("minilm")


def test_a_bad_request_batched_with_good_ones_fails_alone(client) -> None:
    require_model("minilm")

    def call(texts: list[str]) -> str:
        try:
            embed(client, texts)
        except InferenceServerException as exc:
            return exc.status()
        return "ok"

    batches = [["good one"], [""], ["good two"], ["good three"]] * 4
    with ThreadPoolExecutor(max_workers=len(batches)) as pool:
        outcomes = list(pool.map(call, batches))
    assert outcomes == ["ok", "StatusCode.INVALID_ARGUMENT", "ok", "ok"] * 4


def test_identity_returns_its_input(client) -> None:
    require_model("identity")
    data = np.arange(12, dtype=np.float32).reshape(2, 6) / 7
    result = client.infer("identity", [tensor("INPUT0", "FP32", data)], priority=1)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)
