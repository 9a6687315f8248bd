"""A thin, typed wrapper over the generated qosgate.v1 stubs.

It adds what every caller would otherwise write by hand: the API key as call metadata,
building requests from keyword arguments, and one exception type that carries the gRPC
status code, message and server-suggested retry delay.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar

import grpc
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from qosgate.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    batch_pb2,
    batch_pb2_grpc,
    embedding_pb2,
    embedding_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
)

DEFAULT_TARGET = "127.0.0.1:50051"

# Items per CreateBatch message: small enough that a chunk stays far below gRPC's 4 MiB
# message limit for ordinary prompts, large enough that big files upload quickly.
BATCH_CHUNK_ITEMS = 200

ROLES = {
    "system": generation_pb2.ROLE_SYSTEM,
    "user": generation_pb2.ROLE_USER,
    "assistant": generation_pb2.ROLE_ASSISTANT,
}

_Request = TypeVar("_Request", generation_pb2.GenerateRequest, generation_pb2.GenerateStreamRequest)


class ClientError(Exception):
    """A failed call: the gRPC status code name, the server's message and, when the server
    sent google.rpc.RetryInfo (quota refusals, shedding), how long to wait before retrying."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> ClientError:
        code = error.code().name if isinstance(error, grpc.Call) else "UNKNOWN"
        message = error.details() if isinstance(error, grpc.Call) else str(error)
        return cls(code, message or "", _retry_after(error))


def _retry_after(error: grpc.RpcError) -> float | None:
    if not isinstance(error, grpc.Call):
        return None
    status = rpc_status.from_call(error)
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return info.retry_delay.ToTimedelta().total_seconds()
    return None


def sampling_params(
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
) -> generation_pb2.SamplingParams:
    """SamplingParams with only the given fields set (unset ones take the model defaults)."""
    params = generation_pb2.SamplingParams(stop=list(stop))
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
    ):
        if value is not None:
            setattr(params, name, value)
    return params


def chat(messages: Sequence[tuple[str, str]]) -> generation_pb2.Chat:
    """A Chat from (role, content) pairs, role one of system, user, assistant."""
    turns = []
    for role, content in messages:
        if role not in ROLES:
            raise ValueError(f"unknown chat role {role!r}; expected one of {sorted(ROLES)}")
        turns.append(generation_pb2.ChatMessage(role=ROLES[role], content=content))
    return generation_pb2.Chat(messages=turns)


def _fill_generation(
    request: _Request,
    prompt: str | None,
    messages: Sequence[tuple[str, str]] | None,
    priority_class: str | None,
    sampling: generation_pb2.SamplingParams,
) -> _Request:
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt or messages")
    if prompt is not None:
        request.prompt = prompt
    else:
        request.chat.CopyFrom(chat(messages or ()))
    request.sampling.CopyFrom(sampling)
    request.priority_class = priority_class or ""
    return request


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """TLS to the gateway: whom to trust and, for mutual TLS, which certificate to present.

    With `cert_file` and `key_file` a gateway whose tenants map client certificates
    identifies the tenant without an API key.
    """

    ca_file: str | None = None
    """PEM CA certificates the gateway's certificate must chain to; default: system roots."""
    cert_file: str | None = None
    """PEM client certificate chain (mutual TLS); needs `key_file`."""
    key_file: str | None = None
    """PEM private key of `cert_file`."""

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("give both a client certificate and its key, or neither")

    def credentials(self) -> grpc.ChannelCredentials:
        """The files read into grpc's channel credentials (raises OSError if one is unreadable)."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file),
        )


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


class Client:
    """A connection to a qosgate gateway on behalf of one tenant (its API key).

    Use as a context manager, or call close(). Every method raises ClientError on a
    failed call.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        api_key: str | None = None,
        *,
        timeout_s: float | None = None,
        channel: grpc.Channel | None = None,
        tls: TlsOptions | None = None,
    ) -> None:
        if channel is None:
            channel = (
                grpc.insecure_channel(target)
                if tls is None
                else grpc.secure_channel(target, tls.credentials())
            )
        self._channel = channel
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._timeout_s = timeout_s
        self._generation = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self._embedding = embedding_pb2_grpc.EmbeddingServiceStub(self._channel)
        self._admin = admin_pb2_grpc.AdminServiceStub(self._channel)
        self._batch = batch_pb2_grpc.BatchServiceStub(self._channel)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _unary(self, method: grpc.UnaryUnaryMultiCallable, request: Message) -> Any:
        try:
            return method(request, metadata=self._metadata, timeout=self._timeout_s)
        except grpc.RpcError as error:
            raise ClientError.from_rpc_error(error) from None

    def _streamed(self, call: Any) -> Iterator[Any]:
        try:
            yield from call
        except grpc.RpcError as error:
            raise ClientError.from_rpc_error(error) from None
        finally:
            # A no-op after the stream ended; stops the server's work when the caller
            # stops reading early.
            call.cancel()

    def generate(
        self,
        model: str,
        prompt: str | None = None,
        *,
        messages: Sequence[tuple[str, str]] | None = None,
        priority_class: str | None = None,
        **sampling: object,
    ) -> generation_pb2.GenerateResponse:
        """Generates a whole completion. `sampling` takes the SamplingParams fields
        (max_tokens, temperature, top_p, top_k, seed, stop)."""
        request = _fill_generation(
            generation_pb2.GenerateRequest(model=model),
            prompt,
            messages,
            priority_class,
            sampling_params(**sampling),  # type: ignore[arg-type]
        )
        return self._unary(self._generation.Generate, request)

    def generate_stream(
        self,
        model: str,
        prompt: str | None = None,
        *,
        messages: Sequence[tuple[str, str]] | None = None,
        priority_class: str | None = None,
        **sampling: object,
    ) -> Iterator[generation_pb2.GenerateStreamResponse]:
        """Streams a completion as text deltas; the last message carries finish reason,
        usage and timing. Closing the iterator early cancels the call (and generation)."""
        request = _fill_generation(
            generation_pb2.GenerateStreamRequest(model=model),
            prompt,
            messages,
            priority_class,
            sampling_params(**sampling),  # type: ignore[arg-type]
        )
        return self._streamed(
            self._generation.GenerateStream(
                request, metadata=self._metadata, timeout=self._timeout_s
            )
        )

    def embed(
        self, model: str, inputs: Sequence[str], *, priority_class: str | None = None
    ) -> embedding_pb2.EmbedResponse:
        """Embeds texts; one vector per input, in order."""
        request = embedding_pb2.EmbedRequest(
            model=model, inputs=list(inputs), priority_class=priority_class or ""
        )
        return self._unary(self._embedding.Embed, request)

    def usage(self, tenant: str | None = None) -> admin_pb2.GetUsageResponse:
        """Token usage today and this minute; `tenant` other than the caller needs admin."""
        return self._unary(self._admin.GetUsage, admin_pb2.GetUsageRequest(tenant=tenant or ""))

    def create_batch(
        self,
        header: batch_pb2.BatchHeader,
        items: Iterable[batch_pb2.BatchItem],
        *,
        chunk_items: int = BATCH_CHUNK_ITEMS,
    ) -> batch_pb2.Batch:
        """Submits a job, streaming `items` in chunks (the iterable is consumed lazily)."""

        def chunks() -> Iterator[batch_pb2.CreateBatchRequest]:
            yield batch_pb2.CreateBatchRequest(header=header)
            pending: list[batch_pb2.BatchItem] = []
            for item in items:
                pending.append(item)
                if len(pending) >= chunk_items:
                    yield batch_pb2.CreateBatchRequest(items=batch_pb2.BatchItems(items=pending))
                    pending = []
            if pending:
                yield batch_pb2.CreateBatchRequest(items=batch_pb2.BatchItems(items=pending))

        try:
            response = self._batch.CreateBatch(
                chunks(), metadata=self._metadata, timeout=self._timeout_s
            )
        except grpc.RpcError as error:
            raise ClientError.from_rpc_error(error) from None
        return response.batch

    def get_batch(self, batch_id: str) -> batch_pb2.Batch:
        """A job's status and counts."""
        return self._unary(self._batch.GetBatch, batch_pb2.GetBatchRequest(batch_id=batch_id)).batch

    def list_batches(
        self, page_size: int = 0, page_token: str = ""
    ) -> batch_pb2.ListBatchesResponse:
        """One page of the caller's jobs, newest first."""
        return self._unary(
            self._batch.ListBatches,
            batch_pb2.ListBatchesRequest(page_size=page_size, page_token=page_token),
        )

    def cancel_batch(self, batch_id: str) -> batch_pb2.Batch:
        """Stops dispatching a job's remaining items."""
        return self._unary(
            self._batch.CancelBatch, batch_pb2.CancelBatchRequest(batch_id=batch_id)
        ).batch

    def batch_results(
        self, batch_id: str, *, offset: int = 0, follow: bool = False
    ) -> Iterator[batch_pb2.StreamBatchResultsResponse]:
        """A job's results in completion order from `offset`; `follow` waits for the rest."""
        return self._streamed(
            self._batch.StreamBatchResults(
                batch_pb2.StreamBatchResultsRequest(
                    batch_id=batch_id, offset=offset, follow=follow
                ),
                metadata=self._metadata,
            )
        )
