"""Adapters: GenerationRequest → Triton tensors, and Triton responses → chunks and usage.

Requests are checked by decoding them with tritonclient's own tensor helpers (an
independent reader); responses are built the way Triton sends them (raw contents).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2, service_pb2
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from qosgate.adapters.asks import VLLM_DEFAULT_MAX_TOKENS, GenerationAsk, generation_ask
from qosgate import paths
from qosgate.adapters import adapter_for
from qosgate.adapters.chat_template import CHATML, ChatTemplate, TemplateError
from qosgate.generation_types import ChatMessage, FinishReason, GenerationRequest, Role, Sampling
from qosgate.adapters.tensors import TensorReader
from qosgate.adapters.tokenizer import TokenizerNotFound, find_tokenizer, tokenizer_counter
from qosgate.errors import Internal, InvalidArgument


def _inputs(request: service_pb2.ModelInferRequest) -> dict[str, tuple[str, list[int], np.ndarray]]:
    decoded = {}
    for tensor, raw in zip(request.inputs, request.raw_input_contents, strict=True):
        if tensor.datatype == "BYTES":
            values = deserialize_bytes_tensor(raw)
        else:
            dtype = {"BOOL": np.bool_, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32}
            values = np.frombuffer(raw, dtype=dtype[tensor.datatype])
        decoded[tensor.name] = (tensor.datatype, list(tensor.shape), values)
    return decoded


def _response(*, final: bool = False, **outputs: object) -> service_pb2.ModelInferResponse:
    """A response as Triton sends it: typed outputs with raw contents."""
    response = service_pb2.ModelInferResponse(model_name="m", id="r1")
    for name, value in outputs.items():
        tensor = response.outputs.add(name=name, shape=[1])
        if isinstance(value, str):
            tensor.datatype = "BYTES"
            raw = serialize_byte_tensor(np.array([value.encode()], dtype=np.object_)).item()
        else:
            tensor.datatype = "UINT32"
            raw = struct.pack("<I", value)
        response.raw_output_contents.append(raw)
    if final:
        response.parameters["triton_final_response"].bool_param = True
    return response


REQUEST = GenerationRequest(
    model="smollm2",
    prompt="Héllo",
    sampling=Sampling(max_tokens=16, temperature=0.0, top_p=0.9, top_k=5, seed=7, stop=("\n\n", "END")),
    stream=True,
)


def test_vllm_request_carries_the_contract_tensors() -> None:
    request = adapter_for("vllm").encode(REQUEST, request_id="req-1")
    assert request.model_name == "smollm2" and request.id == "req-1"
    assert request.parameters["triton_enable_empty_final_response"].bool_param
    inputs = _inputs(request)
    assert inputs["text_input"][0] == "BYTES" and inputs["text_input"][2][0].decode() == "Héllo"
    assert inputs["stream"][2].tolist() == [True]
    params = json.loads(inputs["sampling_parameters"][2][0])
    assert params == {"max_tokens": 16, "temperature": 0.0, "top_p": 0.9, "top_k": 5, "seed": 7, "stop": ["\n\n", "END"]}
    for flag in ("exclude_input_in_output", "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens"):
        assert inputs[flag][2].tolist() == [True], flag


def test_vllm_sampling_leaves_out_unset_fields() -> None:
    bare = GenerationRequest(model="m", prompt="x", sampling=Sampling(max_tokens=3), stream=False)
    inputs = _inputs(adapter_for("vllm").encode(bare, request_id="r"))
    assert json.loads(inputs["sampling_parameters"][2][0]) == {"max_tokens": 3}
    assert inputs["stream"][2].tolist() == [False]


def test_vllm_stream_sums_deltas_and_takes_the_engine_prompt_count() -> None:
    decoder = adapter_for("vllm").decoder(REQUEST, prompt_tokens_estimate=99)
    first = decoder.feed(_response(text_output="Par", num_input_tokens=12, num_output_tokens=1))
    assert (first.text, first.final) == ("Par", False)
    decoder.feed(_response(text_output="is", num_input_tokens=12, num_output_tokens=2))
    decoder.feed(_response(text_output=".", finish_reason="stop", num_input_tokens=12, num_output_tokens=1))
    last = decoder.feed(_response(final=True))
    assert last.final and last.text == ""
    assert last.finish_reason is FinishReason.STOP
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (12, 4)


def test_vllm_finish_reasons_map_and_cancel_counts_what_was_seen() -> None:
    decoder = adapter_for("vllm").decoder(REQUEST, prompt_tokens_estimate=5)
    decoder.feed(_response(text_output="a", num_output_tokens=1))
    assert decoder.counted().completion_tokens == 1
    assert decoder.counted().prompt_tokens == 5  # estimate until the engine says otherwise
    last = decoder.feed(_response(final=True, text_output="b", finish_reason="length", num_output_tokens=1))
    assert last.finish_reason is FinishReason.LENGTH and last.usage.completion_tokens == 2
    aborted = adapter_for("vllm").decoder(REQUEST, prompt_tokens_estimate=5)
    assert aborted.feed(_response(final=True, finish_reason="abort")).finish_reason is FinishReason.CANCELLED


def test_tensor_reader_reads_raw_and_typed_contents_alike() -> None:
    response = service_pb2.ModelInferResponse()
    raw = serialize_byte_tensor(np.array(["é", "", "two"], dtype=np.object_)).item()
    for name, datatype, contents in (
        ("texts", "BYTES", raw),
        ("ints", "INT64", np.array([-3, 2**40], dtype=np.int64).tobytes() + b"\x01"),  # a stray byte
        ("flags", "BOOL", b"\x01\x00"),
    ):
        response.outputs.add(name=name, datatype=datatype, shape=[1])
        response.raw_output_contents.append(contents)
    typed = response.outputs.add(name="typed", datatype="FP32", shape=[2])
    typed.contents.fp32_contents.extend([0.5, 2.0])
    reader = TensorReader(response)
    assert reader.strings("texts") == ["é", "", "two"]
    assert reader.first_string("texts") == "é"
    assert reader.numbers("ints") == [-3, 2**40]  # whole elements only
    assert reader.first_int("ints") == -3
    assert reader.numbers("flags") == [True, False]
    assert reader.numbers("typed") == [0.5, 2.0]  # no raw contents at its index
    assert reader.strings("absent") is None and reader.first_int("absent") is None


def test_tensor_reader_names_a_truncated_element_and_an_unexpected_type() -> None:
    response = service_pb2.ModelInferResponse()
    response.outputs.add(name="text", datatype="BYTES", shape=[2])
    response.raw_output_contents.append(struct.pack("<I", 2) + b"ok" + b"\x05\x00")
    reader = TensorReader(response)
    assert reader.first_string("text") == "ok"  # the first element is whole
    with pytest.raises(Internal, match="'text': truncated BYTES element"):
        reader.strings("text")
    with pytest.raises(Internal, match="'text': unexpected datatype BYTES"):
        reader.numbers("text")


def test_trtllm_request_follows_the_ensemble_contract() -> None:
    request = adapter_for("trtllm").encode(REQUEST, request_id="req-2")
    inputs = _inputs(request)
    assert inputs["text_input"][:2] == ("BYTES", [1, 1])
    assert inputs["max_tokens"][0] == "INT32" and inputs["max_tokens"][2].tolist() == [16]
    # Always streamed towards the engine, so steps can be counted and cancels stop it.
    assert inputs["stream"][2].tolist() == [True]
    assert inputs["temperature"][0] == "FP32" and inputs["temperature"][2].tolist() == [0.0]
    assert inputs["top_p"][2].tolist() == pytest.approx([0.9])
    assert inputs["top_k"][0] == "INT32" and inputs["top_k"][2].tolist() == [5]
    assert inputs["random_seed"][0] == "UINT64" and inputs["random_seed"][2].tolist() == [7]
    assert inputs["stop_words"][1] == [1, 2]
    assert [w.decode() for w in inputs["stop_words"][2]] == ["\n\n", "END"]
    assert all(shape[0] == 1 for _, shape, _ in inputs.values())  # batch dimension


def test_trtllm_unset_sampling_sends_no_optional_tensors() -> None:
    bare = GenerationRequest(model="m", prompt="x", sampling=Sampling(max_tokens=3), stream=False)
    assert set(_inputs(adapter_for("trtllm").encode(bare, request_id="r"))) == {"text_input", "max_tokens", "stream"}


def test_trtllm_counts_steps_and_infers_length_stop() -> None:
    decoder = adapter_for("trtllm").decoder(REQUEST, prompt_tokens_estimate=4)
    for piece in ("a", "b", "c"):
        assert decoder.feed(_response(text_output=piece)).text == piece
    last = decoder.feed(_response(final=True))
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 3)
    assert last.finish_reason is FinishReason.STOP
    capped = adapter_for("trtllm").decoder(
        GenerationRequest(model="m", prompt="x", sampling=Sampling(max_tokens=2), stream=True),
        prompt_tokens_estimate=1,
    )
    capped.feed(_response(text_output="a"))
    assert capped.feed(_response(final=True, text_output="b")).finish_reason is FinishReason.LENGTH


def test_trtllm_prefers_sequence_length_when_the_model_reports_it() -> None:
    decoder = adapter_for("trtllm").decoder(REQUEST, prompt_tokens_estimate=4)
    decoder.feed(_response(text_output="ab", sequence_length=2))
    last = decoder.feed(_response(final=True, text_output="c", sequence_length=5))
    assert last.usage.completion_tokens == 5


def test_unknown_adapter_is_named() -> None:
    with pytest.raises(ValueError, match="unknown generation adapter 'onnx'"):
        adapter_for("onnx")


def test_chatml_template_renders_turns_and_opens_the_answer() -> None:
    template = ChatTemplate("chatml")
    prompt = template.render([ChatMessage(Role.SYSTEM, "Be brief."), ChatMessage(Role.USER, "Hi")])
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert ChatTemplate(CHATML).render([ChatMessage(Role.USER, "Hi")]).endswith("<|im_start|>assistant\n")


def test_template_errors_are_clear() -> None:
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    refusing = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}ok")
    with pytest.raises(InvalidArgument, match="user first"):
        refusing.render([ChatMessage(Role.ASSISTANT, "x")])
    with pytest.raises(InvalidArgument, match="empty"):
        refusing.render([])


def test_template_sandbox_blocks_python_internals() -> None:
    sneaky = ChatTemplate("{{ messages.__class__.__mro__ }}|{{ ''.__class__.__subclasses__() }}")
    with pytest.raises(InvalidArgument):
        sneaky.render([ChatMessage(Role.USER, "x")])
    quiet = ChatTemplate("{{ messages.__class__ }}")
    assert "class" not in quiet.render([ChatMessage(Role.USER, "x")])


def test_template_globals_of_the_hugging_face_dialect() -> None:
    template = ChatTemplate(
        "{% if tools is defined and tools %}tools{% endif %}{{ undefined_thing }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
        "|{{ strftime_now('%Y') }}"
    )
    rendered = template.render([ChatMessage(Role.USER, "first"), ChatMessage(Role.USER, "second")])
    assert rendered.startswith("first|") and rendered[-4:].isdigit()


def _tiny_tokenizer(path: Path) -> Path:
    """A whitespace word-level tokenizer.json: 'a b c' is 3 tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def test_tokenizer_from_a_file_a_folder_or_the_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HOME", raising=False)
    file = _tiny_tokenizer(tmp_path / "plain" / "tokenizer.json")
    assert find_tokenizer(str(file), tmp_path) == file
    assert find_tokenizer(str(file.parent), tmp_path) == file
    repo = tmp_path / "hf" / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123\n")
    cached = _tiny_tokenizer(repo / "snapshots" / "abc123" / "tokenizer.json")
    assert find_tokenizer("org/tiny", tmp_path / "hf") == cached
    assert tokenizer_counter("org/tiny", tmp_path / "hf")("a b zz a") == 4
    with pytest.raises(TokenizerNotFound, match="org/missing"):
        find_tokenizer("org/missing", tmp_path / "hf")


def _model_config(path: Path) -> model_config_pb2.ModelConfig:
    # Templates (docker/models) carry ${name} placeholders; any integer fits for this check.
    text = re.sub(r"\$\{[a-z_]+\}", "8", path.read_text())
    return text_format.Parse(text, model_config_pb2.ModelConfig())


@pytest.mark.parametrize(
    ("kind", "config"),
    [
        ("vllm", "model_repository/smollm2/config.pbtxt"),
        ("trtllm", "model_repository/smollm2_trtllm/config.pbtxt"),
        ("trtllm", "docker/models/trtllm/ensemble/config.pbtxt"),
    ],
)
def test_requests_match_the_model_configs(kind: str, config: str) -> None:
    """Every tensor an adapter sends exists in the model's config, with its type and rank."""
    model = _model_config(paths.project_root() / config)
    declared = {i.name: i for i in model.input}
    batch_rank = 1 if model.max_batch_size > 0 else 0
    request = adapter_for(kind).encode(REQUEST, request_id="r")
    for tensor in request.inputs:
        assert tensor.name in declared, f"{config} has no input {tensor.name!r}"
        spec = declared[tensor.name]
        expected_type = "TYPE_STRING" if tensor.datatype == "BYTES" else f"TYPE_{tensor.datatype}"
        assert model_config_pb2.DataType.Name(spec.data_type) == expected_type, tensor.name
        assert len(tensor.shape) == len(spec.dims) + batch_rank, tensor.name
    required = {name for name, spec in declared.items() if not spec.optional}
    assert required <= {t.name for t in request.inputs}
    outputs = {o.name for o in model.output}
    assert "text_output" in outputs


# SmolLM2-Instruct's own template (tokenizer_config.json), as a model card would give it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_hugging_face_template_renders_as_transformers_would() -> None:
    prompt = ChatTemplate(SMOLLM2_TEMPLATE).render([ChatMessage(Role.USER, "Hi")])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def _kserve_request(**inputs: tuple[str, bytes]) -> bytes:
    request = service_pb2.ModelInferRequest(model_name="m")
    for name, (datatype, raw) in inputs.items():
        request.inputs.add(name=name, datatype=datatype, shape=[1])
        request.raw_input_contents.append(raw)
    return request.SerializeToString()


def _text(value: str) -> tuple[str, bytes]:
    data = value.encode()
    return "BYTES", len(data).to_bytes(4, "little") + data


@pytest.mark.parametrize(
    ("raw", "ask"),
    [
        # The vLLM backend's contract; numbers as JSON strings are taken, as the backend does.
        (_kserve_request(text_input=_text("hi"), stream=("BOOL", b"\x01"), sampling_parameters=_text('{"max_tokens": "64"}')), GenerationAsk("hi", 64, True)),
        (_kserve_request(text_input=_text("hi"), sampling_parameters=_text('{"max_tokens": "1e3"}')), GenerationAsk("hi", 1000, False)),
        (_kserve_request(text_input=_text("hi"), sampling_parameters=_text("{}")), GenerationAsk("hi", VLLM_DEFAULT_MAX_TOKENS, False)),
        (_kserve_request(text_input=_text("hi")), GenerationAsk("hi", VLLM_DEFAULT_MAX_TOKENS, False)),
        # The TensorRT-LLM ensemble's contract.
        (_kserve_request(text_input=_text("yo"), max_tokens=("INT32", (40).to_bytes(4, "little")), stream=("BOOL", b"\x00")), GenerationAsk("yo", 40, False)),
        # Not a generation request, or not one to read: the engine judges it.
        (_kserve_request(INPUT0=("FP32", b"\x00" * 4)), None),
        (_kserve_request(text_input=_text("hi"), sampling_parameters=_text("{not json")), None),
        (_kserve_request(text_input=_text("hi"), sampling_parameters=_text('{"max_tokens": [1]}')), None),
        (b"text_input\xff", None),  # no protobuf at all
    ],
)
def test_a_kserve_generation_request_tells_what_it_asks(raw: bytes, ask: GenerationAsk | None) -> None:
    found = generation_ask(raw)
    assert (found if found is None else (found.prompt, found.max_tokens, found.streaming)) == (
        ask if ask is None else (ask.prompt, ask.max_tokens, ask.streaming)
    )


_FLAGS = ("return_num_input_tokens", "return_num_output_tokens")
_COUNTS = frozenset({b"num_input_tokens", b"num_output_tokens"})


def _asked(request: service_pb2.ModelInferRequest) -> dict[str, bool | None]:
    reader = TensorReader(request)
    return {flag: None if (value := reader.first_int(flag)) is None else bool(value) for flag in _FLAGS}


def test_a_vllm_request_gets_the_engine_s_counts_added_and_its_raw_values_stay_paired() -> None:
    raw = _kserve_request(text_input=_text("hi"), stream=("BOOL", b"\x01"))
    counts = generation_ask(raw).counts
    assert counts is not None and counts.strip == _COUNTS
    merged = service_pb2.ModelInferRequest.FromString(raw + counts.append)
    assert _asked(merged) == dict.fromkeys(_FLAGS, True)
    assert [t.name for t in merged.inputs] == ["text_input", "stream", *_FLAGS]
    assert len(merged.raw_input_contents) == len(merged.inputs)  # as Triton requires
    assert TensorReader(merged).first_string("text_input") == "hi" and not merged.outputs


def test_a_vllm_request_with_values_in_contents_gets_the_flags_in_contents() -> None:
    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"hi")
    counts = generation_ask(request.SerializeToString()).counts
    assert counts is not None
    merged = service_pb2.ModelInferRequest.FromString(request.SerializeToString() + counts.append)
    assert _asked(merged) == dict.fromkeys(_FLAGS, True) and not merged.raw_input_contents


def test_what_the_caller_asks_itself_stays_its_own() -> None:
    # It sets one flag: only the other is added, and only its output taken out.
    raw = _kserve_request(text_input=_text("hi"), return_num_output_tokens=("BOOL", b"\x01"))
    counts = generation_ask(raw).counts
    assert counts is not None and counts.strip == {b"num_input_tokens"}
    merged = service_pb2.ModelInferRequest.FromString(raw + counts.append)
    assert _asked(merged) == dict.fromkeys(_FLAGS, True)
    # It names the outputs it wants: the count outputs are named too (Triton returns only
    # those named), and taken out unless it named them.
    request = service_pb2.ModelInferRequest.FromString(raw)
    request.outputs.add(name="text_output")
    counts = generation_ask(request.SerializeToString()).counts
    assert counts is not None and counts.strip == _COUNTS
    merged = service_pb2.ModelInferRequest.FromString(request.SerializeToString() + counts.append)
    assert [o.name for o in merged.outputs] == ["text_output", "num_input_tokens", "num_output_tokens"]
    request.outputs.add(name="num_output_tokens")
    assert generation_ask(request.SerializeToString()).counts.strip == {b"num_input_tokens"}
    # It turns a flag off: no counts (a second flag would be a duplicate input).
    off = _kserve_request(text_input=_text("hi"), return_num_input_tokens=("BOOL", b"\x00"))
    assert generation_ask(off).counts is None
    # The TensorRT-LLM contract has no such flags.
    trtllm = _kserve_request(text_input=_text("yo"), max_tokens=("INT32", (40).to_bytes(4, "little")))
    assert generation_ask(trtllm).counts is None
