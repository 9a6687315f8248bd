"""The OpenAI-compatible HTTP API with the official `openai` SDK (sync and async), against a
real gateway (in-process, port 0) and real Triton (smollm2, minilm)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion

from conftest import engine_idle, require_model
from gateway_harness import GatewayThread, gateway_config
from qosgate.launcher import LocalTriton

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

USER_KEY = "oai-user-key"
EMBED_ONLY_KEY = "oai-embed-only-key"
METERED_KEY = "oai-metered-key"
SINGLE_KEY = "oai-single-key"
# tokens_per_minute of the metered tenant: refills 10 tokens a second.
TOKENS_PER_MINUTE = 600
QUESTION = "What is the capital of France?"
COUNTING_PROMPT = "The numbers from one to one thousand: 1, 2, 3, 4,"


@pytest.fixture(scope="module")
def gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    require_model("smollm2")
    require_model("minilm")
    tenant = {"max_class": "critical", "default_class": "standard"}
    config = gateway_config(
        triton.ports.grpc_url,
        models={"smollm2": {"default_temperature": 0, "tokenizer": "HuggingFaceTB/SmolLM2-135M-Instruct"}},
        openai={"listen": "127.0.0.1:0", "service_tiers": {"flex": "batch", "priority": "critical"}},
        tenants=[
            {"name": "user", "api_keys": [{"key": USER_KEY}], **tenant},
            {"name": "embedder", "api_keys": [{"key": EMBED_ONLY_KEY}], "models": ["minilm"]},
            {
                "name": "metered",
                "api_keys": [{"key": METERED_KEY}],
                "limits": {"tokens_per_minute": TOKENS_PER_MINUTE},
                **tenant,
            },
            {"name": "single", "api_keys": [{"key": SINGLE_KEY}], "limits": {"max_concurrent": 1}, **tenant},
        ],
    )
    with GatewayThread(config) as thread:
        yield thread.wait_ready()


def client(gateway: GatewayThread, key: str = USER_KEY, **options: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.openai_url, api_key=key, **options)  # type: ignore[arg-type]


def test_chat_streams_paris_with_usage_and_agrees_with_unary(gateway: GatewayThread) -> None:
    sdk = client(gateway)
    messages = [{"role": "user", "content": QUESTION}]
    stream = sdk.chat.completions.create(
        model="smollm2",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.prompt_tokens > 5 and 0 < usage.completion_tokens <= 48
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    unary = sdk.chat.completions.create(
        model="smollm2", messages=messages, max_completion_tokens=48, temperature=0, seed=7  # type: ignore[arg-type]
    )
    assert unary.object == "chat.completion"
    assert unary.choices[0].message.content == text
    assert unary.usage is not None and unary.usage.completion_tokens == usage.completion_tokens
    # The same call was counted like a gRPC one, under its own rpc label.
    registry = gateway.gateway.metrics.registry
    labels = {"rpc": "openai.ChatCompletions", "model": "smollm2", "tenant": "user", "class": "standard", "code": "OK"}
    assert registry.get_sample_value("qosgate_requests_total", labels) == 2
    # The answer goes back as the next turn's history as the SDK hands it, every field of it.
    history = [*messages, unary.choices[0].message.model_dump(), {"role": "user", "content": "And of Italy?"}]
    follow = sdk.chat.completions.create(model="smollm2", messages=history, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert follow.choices[0].message.content


def test_completions_unary_and_stream_with_stop(gateway: GatewayThread) -> None:
    sdk = client(gateway)
    unary = sdk.completions.create(model="smollm2", prompt=COUNTING_PROMPT, max_tokens=16, temperature=0, stop=[" 9"])
    assert unary.object == "text_completion"
    assert " 5" in unary.choices[0].text and " 9" not in unary.choices[0].text
    assert unary.choices[0].finish_reason == "stop"
    streamed = list(
        sdk.completions.create(model="smollm2", prompt=COUNTING_PROMPT, max_tokens=16, temperature=0, stop=" 9", stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == unary.choices[0].text
    assert unary.usage is not None and unary.usage.prompt_tokens > 10


def test_embeddings_are_384_dimensional_as_floats_and_base64(gateway: GatewayThread) -> None:
    sdk = client(gateway)
    # The SDK asks for base64 by default and decodes it itself.
    default = sdk.embeddings.create(model="minilm", input=["a cat", "a dog", "a car"])
    assert [len(e.embedding) for e in default.data] == [384, 384, 384]
    assert [e.index for e in default.data] == [0, 1, 2]
    floats = sdk.embeddings.create(model="minilm", input="a cat", encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(default.data[0].embedding, abs=1e-5)
    with pytest.raises(openai.BadRequestError, match="384"):
        sdk.embeddings.create(model="minilm", input="a cat", dimensions=128)


async def test_async_client_streams_and_embeds(gateway: GatewayThread) -> None:
    sdk = openai.AsyncOpenAI(base_url=gateway.openai_url, api_key=USER_KEY)
    stream = await sdk.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=32,
        stream=True,
        service_tier="priority",
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    embedded, answer = await asyncio.gather(
        sdk.embeddings.create(model="minilm", input="Paris"),
        sdk.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=32),
    )
    assert "Paris" in text and "Paris" in (answer.choices[0].message.content or "")
    assert len(embedded.data[0].embedding) == 384
    await sdk.close()


def test_models_list_shows_only_the_tenants_models(gateway: GatewayThread) -> None:
    everything = {m.id for m in client(gateway).models.list()}
    assert {"smollm2", "minilm"} <= everything
    assert {m.id for m in client(gateway, EMBED_ONLY_KEY).models.list()} == {"minilm"}
    assert client(gateway, EMBED_ONLY_KEY).models.retrieve("minilm").id == "minilm"
    with pytest.raises(openai.NotFoundError):
        client(gateway, EMBED_ONLY_KEY).models.retrieve("smollm2")


def test_errors_map_to_openai_statuses(gateway: GatewayThread) -> None:
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with pytest.raises(openai.AuthenticationError) as unauthenticated:
        client(gateway, "not-a-key", max_retries=0).chat.completions.create(**chat)  # type: ignore[call-overload]
    assert unauthenticated.value.status_code == 401
    assert unauthenticated.value.code == "unauthenticated"
    with pytest.raises(openai.PermissionDeniedError, match="may not use model 'smollm2'"):
        client(gateway, EMBED_ONLY_KEY).chat.completions.create(**chat)  # type: ignore[call-overload]
    with pytest.raises(openai.BadRequestError, match="n: only 1 is supported"):
        client(gateway).chat.completions.create(**chat, n=2)  # type: ignore[call-overload]
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: frobnicate"):
        client(gateway).chat.completions.create(**chat, extra_body={"frobnicate": 1})  # type: ignore[call-overload]
    with pytest.raises(openai.BadRequestError, match="unknown priority class 'gold'"):
        client(gateway).chat.completions.create(**chat, extra_headers={"x-priority": "gold"})  # type: ignore[call-overload]
    with pytest.raises(openai.BadRequestError, match="service_tier 'scale' is not offered"):
        client(gateway).chat.completions.create(**chat, service_tier="scale")  # type: ignore[call-overload]
    with pytest.raises(openai.PermissionDeniedError, match="may not use class 'critical'"):
        client(gateway, EMBED_ONLY_KEY).embeddings.create(model="minilm", input="x", extra_headers={"x-priority": "critical"})
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client(gateway).chat.completions.create(**{**chat, "max_tokens": 10**12})  # type: ignore[call-overload]
    # An embedding of the LLM (Triton: UNIMPLEMENTED for a decoupled model) is the caller's
    # mistake, and the error says what the model is.
    with pytest.raises(openai.BadRequestError, match="model 'smollm2' streams its responses"):
        client(gateway).embeddings.create(model="smollm2", input="x")
    # So is a chat with the embedding model, which Triton refuses before running it: the
    # error says what the model is not, and keeps Triton's words.
    with pytest.raises(openai.BadRequestError, match="model 'minilm' is not a generation model: .* Triton said: .*inputs"):
        client(gateway).chat.completions.create(**{**chat, "model": "minilm"})  # type: ignore[call-overload]
    raw = httpx.post(f"{gateway.openai_url}/chat/completions", content=b"{not json", headers={"authorization": f"Bearer {USER_KEY}"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    # The caller is identified before anything of its request is read.
    raw = httpx.post(f"{gateway.openai_url}/chat/completions", content=b"{not json", headers={"authorization": "Bearer nope"})
    assert raw.status_code == 401 and raw.json()["error"]["code"] == "unauthenticated"
    assert httpx.get(f"{gateway.openai_url}/nothing-here").status_code == 401
    # A model Triton does not have is 404 from every route.
    with pytest.raises(openai.NotFoundError, match="nope"):
        client(gateway).chat.completions.create(**{**chat, "model": "nope"})  # type: ignore[call-overload]
    with pytest.raises(openai.NotFoundError, match="nope"):
        client(gateway).completions.create(model="nope", prompt="hi", max_tokens=4)
    with pytest.raises(openai.NotFoundError, match="nope"):
        client(gateway).embeddings.create(model="nope", input="x")
    # Triton ends a model name at a NUL: no such name reaches it.
    with pytest.raises(openai.BadRequestError, match="control character"):
        client(gateway).embeddings.create(model="minilm\u0000-public", input="x")
    # Header bytes of any kind (UTF-8 past Latin-1, bytes that are no UTF-8) are read as sent.
    models = f"{gateway.openai_url}/models"
    assert httpx.get(models, headers={"authorization": f"Bearer {USER_KEY}", "x-user": "日本".encode()}).status_code == 200
    assert httpx.get(models, headers={"authorization": f"Bearer {USER_KEY}", "x-user": b"caf\xe9"}).status_code == 200
    assert httpx.get(models, headers={"x-api-key": "ключ".encode()}).status_code == 401
    assert httpx.get(models, headers={"authorization": b"Bearer \xa0"}).status_code == 401
    assert httpx.get(f"{gateway.openai_url}/nothing-here", headers={"authorization": f"Bearer {USER_KEY}"}).status_code == 404


def test_a_request_has_the_time_its_timeout_header_gives_it(gateway: GatewayThread) -> None:
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with pytest.raises(openai.BadRequestError, match="timeout"):
        client(gateway).chat.completions.create(**chat, extra_headers={"timeout": "soon"})  # type: ignore[call-overload]
    # A microsecond passes before the request can be dispatched: 504, as a gRPC deadline;
    # or, where the body came in a later segment than the head, before the body arrived:
    # 408 (which of the two is up to the client's TCP stack).
    with pytest.raises(openai.APIStatusError) as passed:
        client(gateway, max_retries=0).chat.completions.create(**chat, extra_headers={"timeout": "0.000001"})  # type: ignore[call-overload]
    assert passed.value.status_code in (408, 504), passed.value
    assert client(gateway).chat.completions.create(**chat, extra_headers={"x-stainless-timeout": "60"}).choices  # type: ignore[call-overload]
    # Longer than Triton's timeout parameter holds: taken as gRPC's longest. (Sent without
    # the SDK, which adds its own x-stainless-timeout.)
    auth = {"authorization": f"Bearer {USER_KEY}"}
    for longest in ("1e13", "1e300"):
        for name in ("timeout", "x-stainless-timeout"):
            served = httpx.post(f"{gateway.openai_url}/chat/completions", json=chat, headers={**auth, name: longest}, timeout=60)
            assert served.status_code == 200, served.text
            embedded = httpx.post(f"{gateway.openai_url}/embeddings", json={"model": "minilm", "input": "x"},
                                  headers={**auth, name: longest}, timeout=60)
            assert embedded.status_code == 200, embedded.text


def test_over_tokens_per_minute_is_429_with_retry_after_and_the_sdk_waits_it_out(
    gateway: GatewayThread, triton: LocalTriton
) -> None:
    sdk = client(gateway, METERED_KEY)
    # A long generation holds its reservation (prompt + 400 of the 600 tokens a minute)
    # while it runs; a request needing ~270 more does not fit in what is left, and the
    # bucket needs ~8 s to refill that. So that request is sent the moment the long one is
    # dispatched (its tokens reserved), not after its first token (the SDK returns a stream
    # only then), and, with the patient one after it, by clients on the gateway's own loop:
    # CI once saw this process's main thread stall for 20-30 s while the gateway's thread
    # ran on, time enough for the bucket to refill and both requests to fit. An earlier
    # test's requests still in the engine would count as dispatched: start from an idle
    # engine.
    engine_idle(triton, "an earlier request never left the engine")
    request = {"model": "smollm2", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 240}
    # What the patient client sent (times) and was told (retry-after-ms) at each attempt.
    attempts: list[float] = []
    told_ms: list[int] = []

    async def sent(_: httpx.Request) -> None:
        attempts.append(time.monotonic())

    async def answered(response: httpx.Response) -> None:
        told_ms.append(int(response.headers.get("retry-after-ms", 0)))

    async def refused_then_waited_out() -> tuple[openai.RateLimitError, ChatCompletion]:
        hooks = {"request": [sent], "response": [answered]}
        async with (
            openai.AsyncOpenAI(base_url=gateway.openai_url, api_key=METERED_KEY, max_retries=0) as impatient,
            openai.AsyncOpenAI(
                base_url=gateway.openai_url,
                api_key=METERED_KEY,
                max_retries=3,
                http_client=httpx.AsyncClient(event_hooks=hooks),
            ) as patient,
        ):
            deadline = time.monotonic() + 60
            while gateway.gateway.scheduler.snapshot().in_flight.get("smollm2", 0) < 1:
                assert time.monotonic() < deadline, "the long generation was never dispatched"
                await asyncio.sleep(0.01)
            with pytest.raises(openai.RateLimitError) as refused:
                await impatient.chat.completions.create(**request)  # type: ignore[call-overload]
            # The SDK's own retry honours retry-after-ms: the bucket refills meanwhile.
            return refused.value, await patient.chat.completions.create(**request)  # type: ignore[call-overload]

    outcome = asyncio.run_coroutine_threadsafe(refused_then_waited_out(), gateway.loop)
    streams: list[openai.Stream[openai.types.Completion]] = []
    holder = threading.Thread(
        target=lambda: streams.append(
            sdk.completions.create(model="smollm2", prompt=COUNTING_PROMPT, max_tokens=400, temperature=0, stream=True)
        )
    )
    holder.start()
    try:
        refused, reply = outcome.result(120)
    finally:
        holder.join(timeout=120)
        for stream in streams:
            stream.close()
    headers = refused.response.headers
    retry_after_ms = int(headers["retry-after-ms"])
    assert 0 < retry_after_ms <= 60_000 and int(headers["retry-after"]) == -(-retry_after_ms // 1000)
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    assert headers["x-ratelimit-limit-tokens"] == str(TOKENS_PER_MINUTE)
    assert "tokens_per_minute" in refused.message and refused.code == "quota"
    assert streams, "the long generation did not start streaming"
    assert "Paris" in (reply.choices[0].message.content or "")
    # What the patient client's first attempt was told is what it must wait (the bucket
    # may have refilled some since the refusal above).
    assert len(attempts) >= 2, "the patient client was not refused"
    assert 0 < told_ms[0] <= retry_after_ms
    assert attempts[1] - attempts[0] >= 0.9 * told_ms[0] / 1000 - 0.5


def test_a_client_that_disconnects_cancels_its_request(gateway: GatewayThread, triton: LocalTriton) -> None:
    # Count from an idle engine: an earlier test's request may still be finishing.
    tokens_before = engine_idle(triton, "an earlier request never left the engine")["vllm_engine_generation_tokens_total"]
    body = {"model": "smollm2", "prompt": COUNTING_PROMPT, "max_tokens": 300, "temperature": 0, "stream": True}
    headers = {"authorization": f"Bearer {SINGLE_KEY}"}
    with httpx.stream("POST", f"{gateway.openai_url}/completions", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # The tenant (max_concurrent=1) may send again: the disconnect freed its slot...
    sdk = client(gateway, SINGLE_KEY, max_retries=0)
    started = time.monotonic()
    while True:
        try:
            reply = sdk.completions.create(model="smollm2", prompt="Hello", max_tokens=4)
            break
        except openai.RateLimitError:
            assert time.monotonic() - started < 10, "the disconnected stream still holds the tenant's concurrency"
            time.sleep(0.05)
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    # ...and nothing of it holds the model's dispatch window.
    snapshot = gateway.run(_snapshot(gateway))
    assert snapshot.in_flight.get("smollm2", 0) == 0
    # Counted as cancelled, not as a failure of the gateway.
    labels = {"rpc": "openai.Completions", "model": "smollm2", "tenant": "single", "class": "standard"}
    registry = gateway.gateway.metrics.registry
    assert registry.get_sample_value("qosgate_requests_total", {**labels, "code": "CANCELLED"}) == 1
    assert registry.get_sample_value("qosgate_requests_total", {**labels, "code": "INTERNAL"}) is None
    # The engine aborted it: idle again long before 300 tokens could have been generated.
    gauges = engine_idle(triton, "the engine still runs the disconnected request", timeout=10)
    assert gauges["vllm_engine_generation_tokens_total"] - tokens_before < 150


async def _snapshot(gateway: GatewayThread):  # type: ignore[no-untyped-def]
    return gateway.gateway.scheduler.snapshot()
