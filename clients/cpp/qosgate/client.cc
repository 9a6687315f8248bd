#include "qosgate/client.h"

#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace qosgate {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    throw std::runtime_error("qosgate: cannot read the CA file " + path);
  }
  std::ostringstream content;
  content << file.rdbuf();
  return content.str();
}

std::shared_ptr<grpc::ChannelCredentials> Credentials(const Options& options) {
  if (options.ca_file.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions tls;
  tls.pem_root_certs = ReadFile(options.ca_file);
  return grpc::SslCredentials(tls);
}

// The wait before retry n+1 of a refusal without RetryInfo: 100 ms, doubling, at most 5 s.
std::chrono::milliseconds FallbackDelay(int n) {
  return n > 5 ? std::chrono::milliseconds(5000) : std::chrono::milliseconds(100 << n);
}

// Reads a server stream into handle until it ends or handle says stop (which cancels it).
template <typename Message>
grpc::Status Receive(grpc::ClientContext& context, grpc::ClientReader<Message>& reader,
                     const std::function<bool(const Message&)>& handle, bool& delivered) {
  Message message;
  while (reader.Read(&message)) {
    delivered = true;
    if (!handle(message)) {
      context.TryCancel();
      reader.Finish().IgnoreError();
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the caller");
    }
  }
  return reader.Finish();
}

}  // namespace

Client::Client(Options options) : options_(std::move(options)) {
  if (options_.target.empty()) {
    throw std::invalid_argument("qosgate: the target is empty (want host:port)");
  }
  if (options_.api_key.empty()) {
    throw std::invalid_argument("qosgate: the API key is empty");
  }
  if (options_.retries < 0 || options_.timeout.count() < 0) {
    throw std::invalid_argument("qosgate: retries and timeout must not be negative");
  }
  channel_ = grpc::CreateChannel(options_.target, Credentials(options_));
  generation_ = v1::GenerationService::NewStub(channel_);
  embedding_ = v1::EmbeddingService::NewStub(channel_);
  batch_ = v1::BatchService::NewStub(channel_);
  inference_ = inference::GRPCInferenceService::NewStub(channel_);
}

grpc::Status Client::Generate(v1::GenerateRequest request, v1::GenerateResponse* reply) {
  if (request.priority_class().empty()) {
    request.set_priority_class(options_.priority_class);
  }
  return Call(
      [&](grpc::ClientContext& context, bool&) {
        return generation_->Generate(&context, request, reply);
      },
      false);
}

grpc::Status Client::GenerateStream(
    v1::GenerateStreamRequest request,
    const std::function<bool(const v1::GenerateStreamResponse&)>& on_part) {
  if (request.priority_class().empty()) {
    request.set_priority_class(options_.priority_class);
  }
  return Call(
      [&](grpc::ClientContext& context, bool& delivered) {
        auto reader = generation_->GenerateStream(&context, request);
        return Receive(context, *reader, on_part, delivered);
      },
      false);
}

grpc::Status Client::Embed(v1::EmbedRequest request, v1::EmbedResponse* reply) {
  if (request.priority_class().empty()) {
    request.set_priority_class(options_.priority_class);
  }
  return Call(
      [&](grpc::ClientContext& context, bool&) {
        return embedding_->Embed(&context, request, reply);
      },
      false);
}

grpc::Status Client::SubmitBatch(const v1::BatchHeader& header,
                                 const std::vector<v1::BatchItem>& items, v1::Batch* batch) {
  v1::CreateBatchRequest head;
  *head.mutable_header() = header;
  v1::CreateBatchRequest chunk;
  for (const auto& item : items) {
    *chunk.mutable_items()->add_items() = item;
  }
  v1::CreateBatchResponse reply;
  grpc::Status status = Call(
      [&](grpc::ClientContext& context, bool&) {
        auto writer = batch_->CreateBatch(&context, &reply);
        // A refused stream stops taking messages; Finish then returns the status.
        if (writer->Write(head) && writer->Write(chunk)) {
          writer->WritesDone();
        }
        return writer->Finish();
      },
      false);
  if (status.ok()) {
    *batch = reply.batch();
  }
  return status;
}

grpc::Status Client::GetBatch(const std::string& batch_id, v1::Batch* batch) {
  v1::GetBatchRequest request;
  request.set_batch_id(batch_id);
  v1::GetBatchResponse reply;
  grpc::Status status = Call(
      [&](grpc::ClientContext& context, bool&) {
        return batch_->GetBatch(&context, request, &reply);
      },
      false);
  if (status.ok()) {
    *batch = reply.batch();
  }
  return status;
}

grpc::Status Client::BatchResults(
    const std::string& batch_id, bool follow,
    const std::function<bool(const v1::StreamBatchResultsResponse&)>& on_result) {
  v1::StreamBatchResultsRequest request;
  request.set_batch_id(batch_id);
  request.set_follow(follow);
  return Call(
      [&](grpc::ClientContext& context, bool& delivered) {
        auto reader = batch_->StreamBatchResults(&context, request);
        return Receive(context, *reader, on_result, delivered);
      },
      false);
}

grpc::Status Client::ModelInfer(const inference::ModelInferRequest& request,
                                inference::ModelInferResponse* reply) {
  return Call(
      [&](grpc::ClientContext& context, bool&) {
        return inference_->ModelInfer(&context, request, reply);
      },
      true);
}

// Runs attempt on a fresh context carrying the key (and, for KServe, the class) under the
// call's deadline, again after a retryable refusal while retries and the deadline allow.
grpc::Status Client::Call(const Attempt& attempt, bool kserve) {
  using Clock = std::chrono::system_clock;
  const bool bounded = options_.timeout.count() > 0;
  const Clock::time_point deadline = Clock::now() + options_.timeout;
  for (int tried = 0;; ++tried) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer " + options_.api_key);
    if (kserve && !options_.priority_class.empty()) {
      context.AddMetadata(kPriorityHeader, options_.priority_class);
    }
    if (bounded) {
      context.set_deadline(deadline);
    }
    bool delivered = false;
    grpc::Status status = attempt(context, delivered);
    const grpc::StatusCode code = status.error_code();
    const bool retryable =
        code == grpc::StatusCode::RESOURCE_EXHAUSTED || code == grpc::StatusCode::UNAVAILABLE;
    if (status.ok() || !retryable || delivered || tried == options_.retries) {
      return status;
    }
    const std::chrono::milliseconds wait = RetryDelay(status).value_or(FallbackDelay(tried));
    if (bounded && Clock::now() + wait > deadline) {
      return status;  // the retry could not finish in time
    }
    if (options_.on_retry) {
      options_.on_retry(code, wait);
    }
    std::this_thread::sleep_for(wait);
  }
}

std::optional<std::chrono::milliseconds> RetryDelay(const grpc::Status& status) {
  google::rpc::Status details;
  if (status.error_details().empty() || !details.ParseFromString(status.error_details())) {
    return std::nullopt;
  }
  for (const auto& detail : details.details()) {
    google::rpc::RetryInfo info;
    if (detail.UnpackTo(&info)) {
      const auto& delay = info.retry_delay();
      // Rounded up: a retry sent before the delay is up would be refused again.
      return std::chrono::ceil<std::chrono::milliseconds>(
          std::chrono::seconds(delay.seconds()) + std::chrono::nanoseconds(delay.nanos()));
    }
  }
  return std::nullopt;
}

}  // namespace qosgate
