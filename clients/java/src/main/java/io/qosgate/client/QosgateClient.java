package io.qosgate.client;

import com.google.protobuf.Any;
import com.google.protobuf.InvalidProtocolBufferException;
import com.google.rpc.RetryInfo;
import inference.GRPCInferenceServiceGrpc;
import inference.GrpcService.ModelInferRequest;
import inference.GrpcService.ModelInferResponse;
import io.grpc.Context;
import io.grpc.Deadline;
import io.grpc.ManagedChannel;
import io.grpc.Metadata;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.grpc.netty.GrpcSslContexts;
import io.grpc.netty.NettyChannelBuilder;
import io.grpc.protobuf.StatusProto;
import io.grpc.stub.AbstractStub;
import io.grpc.stub.MetadataUtils;
import io.grpc.stub.StreamObserver;
import io.qosgate.v1.Batch;
import io.qosgate.v1.BatchHeader;
import io.qosgate.v1.BatchItem;
import io.qosgate.v1.BatchItems;
import io.qosgate.v1.BatchServiceGrpc;
import io.qosgate.v1.CreateBatchRequest;
import io.qosgate.v1.CreateBatchResponse;
import io.qosgate.v1.EmbedRequest;
import io.qosgate.v1.EmbedResponse;
import io.qosgate.v1.EmbeddingServiceGrpc;
import io.qosgate.v1.GenerateRequest;
import io.qosgate.v1.GenerateResponse;
import io.qosgate.v1.GenerateStreamRequest;
import io.qosgate.v1.GenerateStreamResponse;
import io.qosgate.v1.GenerationServiceGrpc;
import io.qosgate.v1.GetBatchRequest;
import io.qosgate.v1.StreamBatchResultsRequest;
import io.qosgate.v1.StreamBatchResultsResponse;
import java.io.File;
import java.io.IOException;
import java.time.Duration;
import java.util.Iterator;
import java.util.List;
import java.util.Optional;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.function.Consumer;
import java.util.function.Supplier;

/**
 * A connection to a qosgate gateway for one tenant: its qosgate.v1 API (generation,
 * embeddings, batch jobs) and the KServe v2 protocol it relays to Triton, over stubs generated
 * at build time from protos/ and from tritonclient's descriptors (see the README beside
 * src/).
 *
 * <p>It adds what every caller would otherwise write by hand: the API key in the call metadata,
 * a default priority class and deadline, TLS with a CA file, and a retry of calls refused with
 * RESOURCE_EXHAUSTED or UNAVAILABLE that waits as long as the gateway's google.rpc.RetryInfo
 * says. A failed call throws grpc's {@link StatusRuntimeException}; {@link #retryDelay} reads
 * its RetryInfo. Thread-safe.
 */
public final class QosgateClient implements AutoCloseable {
  /** Carries the priority class of KServe calls, whose requests have no field for it. */
  public static final String PRIORITY_HEADER = "x-priority";

  /** Told the refusal's code and the wait before each retry. */
  public interface RetryListener {
    void onRetry(Status.Code code, Duration wait);
  }

  /** How the client reaches the gateway and on whose behalf. */
  public static final class Options {
    private String target;
    private String apiKey;
    private String priorityClass = "";
    private Duration timeout;
    private File caFile;
    private int retries;
    private RetryListener onRetry = (code, wait) -> {};

    /** The gateway's address, host:port. */
    public Options target(String target) {
      this.target = target;
      return this;
    }

    /** The tenant's key, sent as "authorization: Bearer &lt;key&gt;" on every call. */
    public Options apiKey(String apiKey) {
      this.apiKey = apiKey;
      return this;
    }

    /** The class of every call that names none; empty: the tenant's default. */
    public Options priorityClass(String priorityClass) {
      this.priorityClass = priorityClass;
      return this;
    }

    /** Bounds each call, its retries included; null leaves calls unbounded. */
    public Options timeout(Duration timeout) {
      this.timeout = timeout;
      return this;
    }

    /** Turns on TLS trusting the PEM certificates in this file; null: plaintext. */
    public Options caFile(File caFile) {
      this.caFile = caFile;
      return this;
    }

    /**
     * How many times a call refused with RESOURCE_EXHAUSTED or UNAVAILABLE is tried again. A
     * stream is retried only when it failed before its first message.
     */
    public Options retries(int retries) {
      this.retries = retries;
      return this;
    }

    /** Told before each retry. */
    public Options onRetry(RetryListener onRetry) {
      this.onRetry = onRetry;
      return this;
    }
  }

  /** One try of a call, under the call's deadline (null: none). */
  private interface Attempt<T> {
    T run(Deadline deadline, Progress progress);
  }

  /** Whether an attempt handed anything to the caller: it is not retried then. */
  private static final class Progress {
    boolean delivered;
  }

  private final Options options;
  private final ManagedChannel channel;
  private final GenerationServiceGrpc.GenerationServiceBlockingStub generation;
  private final EmbeddingServiceGrpc.EmbeddingServiceBlockingStub embedding;
  private final BatchServiceGrpc.BatchServiceBlockingStub batch;
  private final BatchServiceGrpc.BatchServiceStub batchUploads;
  private final GRPCInferenceServiceGrpc.GRPCInferenceServiceBlockingStub inference;

  private QosgateClient(Options options, ManagedChannel channel) {
    this.options = options;
    this.channel = channel;
    Metadata key = header("authorization", "Bearer " + options.apiKey);
    generation = withHeaders(GenerationServiceGrpc.newBlockingStub(channel), key);
    embedding = withHeaders(EmbeddingServiceGrpc.newBlockingStub(channel), key);
    batch = withHeaders(BatchServiceGrpc.newBlockingStub(channel), key);
    batchUploads = withHeaders(BatchServiceGrpc.newStub(channel), key);
    Metadata inferHeaders = key;
    if (!options.priorityClass.isEmpty()) {
      inferHeaders = header(PRIORITY_HEADER, options.priorityClass);
      inferHeaders.merge(key);
    }
    inference = withHeaders(GRPCInferenceServiceGrpc.newBlockingStub(channel), inferHeaders);
  }

  /**
   * Checks the options and connects (lazily: the first call dials).
   *
   * @throws IllegalArgumentException for a missing target or key, or negative retries
   * @throws IOException when the CA file cannot be read as PEM certificates
   */
  public static QosgateClient connect(Options options) throws IOException {
    if (options.target == null || options.target.isEmpty()) {
      throw new IllegalArgumentException("qosgate: the target is empty (want host:port)");
    }
    if (options.apiKey == null || options.apiKey.isEmpty()) {
      throw new IllegalArgumentException("qosgate: the API key is empty");
    }
    if (options.retries < 0) {
      throw new IllegalArgumentException("qosgate: retries must not be negative");
    }
    NettyChannelBuilder builder = NettyChannelBuilder.forTarget(options.target);
    if (options.caFile == null) {
      builder.usePlaintext();
    } else {
      if (!options.caFile.canRead()) {
        throw new IOException("qosgate: cannot read the CA file " + options.caFile);
      }
      builder.sslContext(GrpcSslContexts.forClient().trustManager(options.caFile).build());
    }
    return new QosgateClient(options, builder.build());
  }

  @Override
  public void close() throws InterruptedException {
    channel.shutdownNow().awaitTermination(5, TimeUnit.SECONDS);
  }

  /** Returns a whole completion. */
  public GenerateResponse generate(GenerateRequest request) {
    GenerateRequest classed =
        request.getPriorityClass().isEmpty()
            ? request.toBuilder().setPriorityClass(options.priorityClass).build()
            : request;
    return call((deadline, progress) -> bounded(generation, deadline).generate(classed));
  }

  /**
   * Streams a completion, handing each message to onPart as it arrives; the last one carries
   * the finish reason, usage and timing. An exception from onPart cancels the call (which stops
   * generation in the engine) and propagates.
   */
  public void generateStream(GenerateStreamRequest request, Consumer<GenerateStreamResponse> onPart) {
    GenerateStreamRequest classed =
        request.getPriorityClass().isEmpty()
            ? request.toBuilder().setPriorityClass(options.priorityClass).build()
            : request;
    call(
        (deadline, progress) ->
            receive(() -> bounded(generation, deadline).generateStream(classed), onPart, progress));
  }

  /** Returns one vector per input text, in order. */
  public EmbedResponse embed(EmbedRequest request) {
    EmbedRequest classed =
        request.getPriorityClass().isEmpty()
            ? request.toBuilder().setPriorityClass(options.priorityClass).build()
            : request;
    return call((deadline, progress) -> bounded(embedding, deadline).embed(classed));
  }

  /**
   * Creates a batch job: the header, then the items in one chunk. The gateway queues the job
   * only once every item is valid, so a refused submission is retried whole.
   */
  public Batch submitBatch(BatchHeader header, List<BatchItem> items) {
    return call(
        (deadline, progress) -> {
          CompletableFuture<CreateBatchResponse> reply = new CompletableFuture<>();
          StreamObserver<CreateBatchRequest> upload =
              bounded(batchUploads, deadline).createBatch(observe(reply));
          upload.onNext(CreateBatchRequest.newBuilder().setHeader(header).build());
          upload.onNext(
              CreateBatchRequest.newBuilder()
                  .setItems(BatchItems.newBuilder().addAllItems(items))
                  .build());
          upload.onCompleted();
          try {
            return reply.get().getBatch();
          } catch (ExecutionException failure) {
            throw Status.fromThrowable(failure.getCause()).asRuntimeException();
          } catch (InterruptedException interrupted) {
            Thread.currentThread().interrupt();
            throw Status.CANCELLED.withCause(interrupted).asRuntimeException();
          }
        });
  }

  /** Returns a job's status and counts. */
  public Batch getBatch(String batchId) {
    GetBatchRequest request = GetBatchRequest.newBuilder().setBatchId(batchId).build();
    return call((deadline, progress) -> bounded(batch, deadline).getBatch(request).getBatch());
  }

  /**
   * Hands a job's results to onResult in completion order; with follow it waits for results
   * still to come until the job ends.
   */
  public void batchResults(
      String batchId, boolean follow, Consumer<StreamBatchResultsResponse> onResult) {
    StreamBatchResultsRequest request =
        StreamBatchResultsRequest.newBuilder().setBatchId(batchId).setFollow(follow).build();
    call(
        (deadline, progress) ->
            receive(() -> bounded(batch, deadline).streamBatchResults(request), onResult, progress));
  }

  /**
   * Runs a KServe v2 inference through the gateway (the tenant's rules, quotas and scheduling
   * apply as to any call).
   */
  public ModelInferResponse modelInfer(ModelInferRequest request) {
    return call((deadline, progress) -> bounded(inference, deadline).modelInfer(request));
  }

  /** The wait the gateway asked for in the failure's google.rpc.RetryInfo, if there was one. */
  public static Optional<Duration> retryDelay(Throwable failure) {
    com.google.rpc.Status status = StatusProto.fromThrowable(failure);
    if (status == null) {
      return Optional.empty();
    }
    for (Any detail : status.getDetailsList()) {
      if (detail.is(RetryInfo.class)) {
        try {
          com.google.protobuf.Duration delay = detail.unpack(RetryInfo.class).getRetryDelay();
          return Optional.of(Duration.ofSeconds(delay.getSeconds(), delay.getNanos()));
        } catch (InvalidProtocolBufferException malformed) {
          return Optional.empty();
        }
      }
    }
    return Optional.empty();
  }

  /**
   * Runs attempt under the call's deadline, again after a retryable refusal while retries and
   * the deadline allow, unless the attempt already handed something to the caller.
   */
  private <T> T call(Attempt<T> attempt) {
    Deadline deadline =
        options.timeout == null
            ? null
            : Deadline.after(options.timeout.toNanos(), TimeUnit.NANOSECONDS);
    for (int tried = 0; ; tried++) {
      Progress progress = new Progress();
      try {
        return attempt.run(deadline, progress);
      } catch (StatusRuntimeException refused) {
        Status.Code code = refused.getStatus().getCode();
        boolean retryable = code == Status.Code.RESOURCE_EXHAUSTED || code == Status.Code.UNAVAILABLE;
        if (!retryable || progress.delivered || tried == options.retries) {
          throw refused;
        }
        Duration wait = retryDelay(refused).orElse(fallbackDelay(tried));
        if (deadline != null && deadline.timeRemaining(TimeUnit.NANOSECONDS) < wait.toNanos()) {
          throw refused; // the retry could not finish in time
        }
        options.onRetry.onRetry(code, wait);
        try {
          // Rounded up: a retry sent before the delay is up would be refused again.
          Thread.sleep((wait.toNanos() + 999_999) / 1_000_000);
        } catch (InterruptedException interrupted) {
          Thread.currentThread().interrupt();
          throw refused;
        }
      }
    }
  }

  /**
   * Hands a server stream's messages to handle until it ends, inside a cancellable context so
   * that a handler's exception cancels the call.
   */
  private static <T> Void receive(
      Supplier<Iterator<T>> open, Consumer<T> handle, Progress progress) {
    Context.CancellableContext scope = Context.current().withCancellation();
    Context previous = scope.attach();
    try {
      Iterator<T> messages = open.get();
      while (messages.hasNext()) {
        T message = messages.next();
        progress.delivered = true;
        handle.accept(message);
      }
      return null;
    } finally {
      scope.detach(previous);
      scope.cancel(null);
    }
  }

  /** The wait before retry n+1 of a refusal without RetryInfo: 100 ms, doubling, at most 5 s. */
  private static Duration fallbackDelay(int n) {
    return n > 5 ? Duration.ofSeconds(5) : Duration.ofMillis(100L << n);
  }

  private static <S extends AbstractStub<S>> S bounded(S stub, Deadline deadline) {
    return deadline == null ? stub : stub.withDeadline(deadline);
  }

  private static <S extends AbstractStub<S>> S withHeaders(S stub, Metadata headers) {
    return stub.withInterceptors(MetadataUtils.newAttachHeadersInterceptor(headers));
  }

  private static Metadata header(String name, String value) {
    Metadata headers = new Metadata();
    headers.put(Metadata.Key.of(name, Metadata.ASCII_STRING_MARSHALLER), value);
    return headers;
  }

  private static <T> StreamObserver<T> observe(CompletableFuture<T> reply) {
    return new StreamObserver<>() {
      @Override
      public void onNext(T value) {
        reply.complete(value);
      }

      @Override
      public void onError(Throwable failure) {
        reply.completeExceptionally(failure);
      }

      @Override
      public void onCompleted() {
        reply.complete(null);
      }
    };
  }
}
