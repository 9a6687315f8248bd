// A client of a qosgate gateway: its qosgate.v1 API (generation, embeddings, batch jobs) and
// the KServe v2 protocol it relays to Triton, over stubs generated at build time from protos/
// and from tritonclient's descriptors (see ../README.md).
//
// It adds what every caller would otherwise write by hand: the API key in the call metadata,
// a default priority class and deadline, TLS with a CA file, and a retry of calls refused
// with RESOURCE_EXHAUSTED or UNAVAILABLE that waits as long as the gateway's
// google.rpc.RetryInfo says. Every call returns the grpc::Status of its last attempt.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "grpc_service.grpc.pb.h"
#include "qosgate/v1/batch.grpc.pb.h"
#include "qosgate/v1/embedding.grpc.pb.h"
#include "qosgate/v1/generation.grpc.pb.h"

namespace qosgate {

// Carries the priority class of KServe calls, whose requests have no field for it.
inline constexpr char kPriorityHeader[] = "x-priority";

// How a Client reaches the gateway and on whose behalf.
struct Options {
  // The gateway's address, host:port.
  std::string target;
  // The tenant's key, sent as "authorization: Bearer <key>" on every call.
  std::string api_key;
  // The class of every call that names none; empty: the tenant's default.
  std::string priority_class;
  // Bounds each call, its retries included; zero leaves calls unbounded.
  std::chrono::milliseconds timeout{0};
  // Turns on TLS trusting the PEM certificates in this file; empty: plaintext.
  std::string ca_file;
  // How many times a call refused with RESOURCE_EXHAUSTED or UNAVAILABLE is tried again. A
  // stream is retried only when it failed before its first message.
  int retries = 0;
  // Told the refusal's code and the wait before each retry, when set.
  std::function<void(grpc::StatusCode, std::chrono::milliseconds)> on_retry;
};

// A connection to the gateway for one tenant; safe for concurrent use.
class Client {
 public:
  // Checks the options and connects (lazily: the first call dials). Throws
  // std::invalid_argument for a missing target or key or negative retries, and
  // std::runtime_error when the CA file cannot be read.
  explicit Client(Options options);

  // Returns a whole completion.
  grpc::Status Generate(v1::GenerateRequest request, v1::GenerateResponse* reply);

  // Streams a completion, handing each message to on_part as it arrives; the last one
  // carries the finish reason, usage and timing. on_part returning false cancels the call
  // (which stops generation in the engine).
  grpc::Status GenerateStream(v1::GenerateStreamRequest request,
                              const std::function<bool(const v1::GenerateStreamResponse&)>& on_part);

  // Returns one vector per input text, in order.
  grpc::Status Embed(v1::EmbedRequest request, v1::EmbedResponse* reply);

  // Creates a batch job: the header, then the items in one chunk. The gateway queues the job
  // only once every item is valid, so a refused submission is retried whole.
  grpc::Status SubmitBatch(const v1::BatchHeader& header, const std::vector<v1::BatchItem>& items,
                           v1::Batch* batch);

  // Returns a job's status and counts.
  grpc::Status GetBatch(const std::string& batch_id, v1::Batch* batch);

  // Hands a job's results to on_result in completion order; with follow it waits for results
  // still to come until the job ends. on_result returning false cancels the call.
  grpc::Status BatchResults(const std::string& batch_id, bool follow,
                            const std::function<bool(const v1::StreamBatchResultsResponse&)>& on_result);

  // Runs a KServe v2 inference through the gateway (the tenant's rules, quotas and
  // scheduling apply as to any call).
  grpc::Status ModelInfer(const inference::ModelInferRequest& request,
                          inference::ModelInferResponse* reply);

 private:
  // One try of a call on a fresh context; sets `delivered` once it handed anything to the
  // caller, which rules a retry out.
  using Attempt = std::function<grpc::Status(grpc::ClientContext&, bool& delivered)>;

  grpc::Status Call(const Attempt& attempt, bool kserve);

  Options options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::GenerationService::Stub> generation_;
  std::unique_ptr<v1::EmbeddingService::Stub> embedding_;
  std::unique_ptr<v1::BatchService::Stub> batch_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> inference_;
};

// The wait the gateway asked for in the status's google.rpc.RetryInfo, if there was one.
std::optional<std::chrono::milliseconds> RetryDelay(const grpc::Status& status);

}  // namespace qosgate
