// qosgate-example calls a qosgate gateway through qosgate::Client: unary and streamed
// generation, embeddings, a batch job and a KServe ModelInfer on the identity model. The
// address comes from --target or QOSGATE_TARGET, the key from QOSGATE_API_KEY only (a flag
// would show it in the process list). See ../README.md.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "qosgate/client.h"

namespace {

constexpr char kUsage[] = R"(usage: qosgate-example [flags] COMMAND ARG...

commands:
  generate PROMPT   unary Generate on smollm2; prints the answer
  stream PROMPT     GenerateStream on smollm2; prints the text as it arrives
  embed TEXT...     Embed on minilm; one line per text: its dimension and values
  batch PROMPT TEXT a batch job with one generation and one embedding; prints its results
  infer NUMBER...   KServe ModelInfer on identity (FP32, shape [1, N]); prints OUTPUT0

flags:
  --target HOST:PORT gateway address (default: $QOSGATE_TARGET, else 127.0.0.1:50051)
  --ca FILE          PEM CA file: TLS trusting it (default: plaintext)
  --class NAME       priority class (default: the tenant's)
  --deadline-ms N    deadline of each call, retries included (default 60000)
  --retries N        retries of a call refused with RESOURCE_EXHAUSTED or UNAVAILABLE (default 3)
  --max-tokens N     most tokens to generate (default 32)
  --repeat N         run the command N times in a row (a quota's refusal and the retry show)

environment: QOSGATE_API_KEY (the tenant's key, required), QOSGATE_TARGET
)";

// The codes as the gRPC specification spells them, indexed by value.
constexpr const char* kCodeNames[] = {
    "OK",        "CANCELLED",         "UNKNOWN",            "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",     "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
    "UNIMPLEMENTED", "INTERNAL",      "UNAVAILABLE",        "DATA_LOSS",
    "UNAUTHENTICATED"};

const char* CodeName(grpc::StatusCode code) {
  const auto index = static_cast<std::size_t>(code);
  return index < std::size(kCodeNames) ? kCodeNames[index] : "UNKNOWN";
}

// A flag's value as a whole number >= 0, or std::invalid_argument naming the flag.
long Count(const std::string& flag, const std::string& value) {
  char* end = nullptr;
  const long count = std::strtol(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || count < 0) {
    throw std::invalid_argument(flag + " takes a whole number >= 0, not '" + value + "'");
  }
  return count;
}

double Seconds(std::chrono::milliseconds wait) { return wait.count() / 1000.0; }

// Prints a failed call as "error: CODE: message", with the gateway's retry delay if any.
int Report(const grpc::Status& status) {
  std::fprintf(stderr, "error: %s: %s", CodeName(status.error_code()),
               status.error_message().c_str());
  if (const auto wait = qosgate::RetryDelay(status)) {
    std::fprintf(stderr, " (retry after %.3f s)", Seconds(*wait));
  }
  std::fprintf(stderr, "\n");
  return 1;
}

std::string Floats(const float* values, std::size_t count) {
  std::string words;
  char word[32];
  for (std::size_t i = 0; i < count; ++i) {
    std::snprintf(word, sizeof word, "%s%.9g", i ? " " : "", values[i]);
    words += word;
  }
  return words;
}

qosgate::v1::Chat UserChat(const std::string& prompt) {
  qosgate::v1::Chat chat;
  auto* message = chat.add_messages();
  message->set_role(qosgate::v1::ROLE_USER);
  message->set_content(prompt);
  return chat;
}

int Generate(qosgate::Client& client, const std::string& prompt,
             const qosgate::v1::SamplingParams& sampling) {
  qosgate::v1::GenerateRequest request;
  request.set_model("smollm2");
  *request.mutable_chat() = UserChat(prompt);
  *request.mutable_sampling() = sampling;
  qosgate::v1::GenerateResponse reply;
  if (auto status = client.Generate(request, &reply); !status.ok()) {
    return Report(status);
  }
  std::printf("%s\n", reply.text().c_str());
  std::fprintf(stderr, "[done] finish=%s prompt_tokens=%u completion_tokens=%u\n",
               qosgate::v1::FinishReason_Name(reply.finish_reason()).c_str(),
               reply.usage().prompt_tokens(), reply.usage().completion_tokens());
  return 0;
}

int Stream(qosgate::Client& client, const std::string& prompt,
           const qosgate::v1::SamplingParams& sampling) {
  qosgate::v1::GenerateStreamRequest request;
  request.set_model("smollm2");
  *request.mutable_chat() = UserChat(prompt);
  *request.mutable_sampling() = sampling;
  int parts = 0;
  qosgate::v1::GenerateStreamResponse last;
  grpc::Status status =
      client.GenerateStream(request, [&](const qosgate::v1::GenerateStreamResponse& part) {
        std::fputs(part.text().c_str(), stdout);
        std::fflush(stdout);  // each delta shows as it arrives
        ++parts;
        last = part;
        return true;
      });
  std::printf("\n");
  if (!status.ok()) {
    return Report(status);
  }
  std::fprintf(stderr, "[done] finish=%s parts=%d prompt_tokens=%u completion_tokens=%u\n",
               qosgate::v1::FinishReason_Name(last.finish_reason()).c_str(), parts,
               last.usage().prompt_tokens(), last.usage().completion_tokens());
  return 0;
}

int Embed(qosgate::Client& client, const std::vector<std::string>& texts) {
  qosgate::v1::EmbedRequest request;
  request.set_model("minilm");
  for (const auto& text : texts) {
    request.add_inputs(text);
  }
  qosgate::v1::EmbedResponse reply;
  if (auto status = client.Embed(request, &reply); !status.ok()) {
    return Report(status);
  }
  for (const auto& embedding : reply.embeddings()) {
    std::printf("%d values: %s\n", embedding.values_size(),
                Floats(embedding.values().data(), embedding.values_size()).c_str());
  }
  return 0;
}

int Batch(qosgate::Client& client, const std::string& prompt, const std::string& text,
          const qosgate::v1::SamplingParams& sampling) {
  std::vector<qosgate::v1::BatchItem> items(2);
  items[0].set_custom_id("generate-1");
  auto* generate = items[0].mutable_generate();
  generate->set_model("smollm2");
  *generate->mutable_chat() = UserChat(prompt);
  *generate->mutable_sampling() = sampling;
  items[1].set_custom_id("embed-1");
  items[1].mutable_embed()->set_model("minilm");
  items[1].mutable_embed()->add_inputs(text);
  qosgate::v1::BatchHeader header;
  header.set_description("qosgate-example");
  qosgate::v1::Batch job;
  if (auto status = client.SubmitBatch(header, items, &job); !status.ok()) {
    return Report(status);
  }
  std::printf("batch %s submitted (%zu items)\n", job.id().c_str(), items.size());
  grpc::Status status = client.BatchResults(
      job.id(), true, [](const qosgate::v1::StreamBatchResultsResponse& result) {
        const char* id = result.custom_id().c_str();
        if (result.has_generation()) {
          std::printf("%s: %s\n", id, result.generation().text().c_str());
        } else if (result.has_embedding()) {
          std::printf("%s: %d values\n", id, result.embedding().embeddings(0).values_size());
        } else if (result.has_error()) {
          std::printf("%s: error %s: %s\n", id, result.error().code().c_str(),
                      result.error().message().c_str());
        }
        return true;
      });
  if (!status.ok()) {
    return Report(status);
  }
  if (status = client.GetBatch(job.id(), &job); !status.ok()) {
    return Report(status);
  }
  std::printf("batch %s %s succeeded=%u failed=%u\n", job.id().c_str(),
              qosgate::v1::BatchStatus_Name(job.status()).c_str(), job.counts().succeeded(),
              job.counts().failed());
  return 0;
}

int Infer(qosgate::Client& client, const std::vector<std::string>& numbers) {
  std::vector<float> values;
  for (const auto& number : numbers) {
    char* end = nullptr;
    values.push_back(std::strtof(number.c_str(), &end));
    if (number.empty() || *end != '\0') {
      throw std::invalid_argument("infer takes numbers: '" + number + "' is not one");
    }
  }
  inference::ModelInferRequest request;
  request.set_model_name("identity");
  auto* input = request.add_inputs();
  input->set_name("INPUT0");
  input->set_datatype("FP32");
  input->add_shape(1);
  input->add_shape(static_cast<std::int64_t>(values.size()));
  // KServe's raw tensors are little-endian, as this machine's floats are.
  request.add_raw_input_contents(reinterpret_cast<const char*>(values.data()),
                                 values.size() * sizeof(float));
  inference::ModelInferResponse reply;
  if (auto status = client.ModelInfer(request, &reply); !status.ok()) {
    return Report(status);
  }
  if (reply.outputs_size() != 1 || reply.raw_output_contents_size() != 1) {
    std::fprintf(stderr, "error: identity answered %d outputs, %d raw contents; want 1 and 1\n",
                 reply.outputs_size(), reply.raw_output_contents_size());
    return 1;
  }
  const std::string& raw = reply.raw_output_contents(0);
  std::vector<float> out(raw.size() / sizeof(float));
  std::memcpy(out.data(), raw.data(), out.size() * sizeof(float));
  std::string shape;
  for (const auto dim : reply.outputs(0).shape()) {
    shape += (shape.empty() ? "" : " ") + std::to_string(dim);
  }
  std::printf("%s [%s]: %s\n", reply.outputs(0).name().c_str(), shape.c_str(),
              Floats(out.data(), out.size()).c_str());
  return 0;
}

int RunCommand(qosgate::Client& client, const std::string& command,
               const std::vector<std::string>& operands,
               const qosgate::v1::SamplingParams& sampling) {
  if (command == "generate" && operands.size() == 1) {
    return Generate(client, operands[0], sampling);
  }
  if (command == "stream" && operands.size() == 1) {
    return Stream(client, operands[0], sampling);
  }
  if (command == "embed" && !operands.empty()) {
    return Embed(client, operands);
  }
  if (command == "batch" && operands.size() == 2) {
    return Batch(client, operands[0], operands[1], sampling);
  }
  if (command == "infer" && !operands.empty()) {
    return Infer(client, operands);
  }
  throw std::invalid_argument("unknown command or wrong arguments: '" + command + "'");
}

int Run(int argc, char** argv) {
  const char* env_target = std::getenv("QOSGATE_TARGET");
  const char* env_key = std::getenv("QOSGATE_API_KEY");
  qosgate::Options options;
  options.target = env_target && *env_target ? env_target : "127.0.0.1:50051";
  options.api_key = env_key ? env_key : "";
  options.timeout = std::chrono::milliseconds(60000);
  options.retries = 3;
  options.on_retry = [](grpc::StatusCode code, std::chrono::milliseconds wait) {
    std::fprintf(stderr, "retrying in %.3f s after %s\n", Seconds(wait), CodeName(code));
  };
  qosgate::v1::SamplingParams sampling;
  sampling.set_max_tokens(32);
  sampling.set_temperature(0);  // greedy
  long repeat = 1;
  int next = 1;
  for (; next < argc && std::strncmp(argv[next], "--", 2) == 0; next += 2) {
    const std::string flag = argv[next];
    if (next + 1 == argc) {
      throw std::invalid_argument("flag " + flag + " needs a value");
    }
    const std::string value = argv[next + 1];
    if (flag == "--target") {
      options.target = value;
    } else if (flag == "--ca") {
      options.ca_file = value;
    } else if (flag == "--class") {
      options.priority_class = value;
    } else if (flag == "--deadline-ms") {
      options.timeout = std::chrono::milliseconds(Count(flag, value));
    } else if (flag == "--retries") {
      options.retries = static_cast<int>(Count(flag, value));
    } else if (flag == "--max-tokens") {
      sampling.set_max_tokens(static_cast<std::uint32_t>(Count(flag, value)));
    } else if (flag == "--repeat") {
      repeat = Count(flag, value);
    } else {
      throw std::invalid_argument("unknown flag " + flag);
    }
  }
  if (repeat == 0) {
    throw std::invalid_argument("--repeat takes a whole number >= 1");
  }
  const std::string command = next < argc ? argv[next] : "";
  const std::vector<std::string> operands(argv + std::min(next + 1, argc), argv + argc);
  qosgate::Client client(options);
  int status = 0;
  for (long n = 0; n < repeat && status == 0; ++n) {
    status = RunCommand(client, command, operands, sampling);
  }
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::invalid_argument& bad) {
    std::fprintf(stderr, "error: %s\n%s", bad.what(), kUsage);
    return 2;
  } catch (const std::runtime_error& failure) {
    std::fprintf(stderr, "error: %s\n", failure.what());
    return 2;
  }
}
