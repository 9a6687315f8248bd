package io.qosgate.example;

import com.google.protobuf.ByteString;
import inference.GrpcService.ModelInferRequest;
import inference.GrpcService.ModelInferResponse;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.qosgate.client.QosgateClient;
import io.qosgate.v1.Batch;
import io.qosgate.v1.BatchHeader;
import io.qosgate.v1.BatchItem;
import io.qosgate.v1.Chat;
import io.qosgate.v1.ChatMessage;
import io.qosgate.v1.EmbedRequest;
import io.qosgate.v1.EmbedResponse;
import io.qosgate.v1.Embedding;
import io.qosgate.v1.GenerateRequest;
import io.qosgate.v1.GenerateResponse;
import io.qosgate.v1.GenerateStreamRequest;
import io.qosgate.v1.GenerateStreamResponse;
import io.qosgate.v1.Role;
import io.qosgate.v1.SamplingParams;
import java.io.File;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.time.Duration;
import java.util.Arrays;
import java.util.List;
import java.util.StringJoiner;

/**
 * Calls a qosgate gateway through {@link QosgateClient}: unary and streamed generation,
 * embeddings, a batch job and a KServe ModelInfer on the identity model. The address comes
 * from --target or QOSGATE_TARGET, the key from QOSGATE_API_KEY only (a flag would show it in
 * the process list). See the README beside src/.
 */
public final class Example {
  private static final String USAGE =
      String.join(
          "\n",
          "usage: java -jar qosgate-example.jar [flags] COMMAND ARG...",
          "",
          "commands:",
          "  generate PROMPT   unary Generate on smollm2; prints the answer",
          "  stream PROMPT     GenerateStream on smollm2; prints the text as it arrives",
          "  embed TEXT...     Embed on minilm; one line per text: its dimension and values",
          "  batch PROMPT TEXT a batch job with one generation and one embedding; prints its results",
          "  infer NUMBER...   KServe ModelInfer on identity (FP32, shape [1, N]); prints OUTPUT0",
          "",
          "flags:",
          "  --target HOST:PORT gateway address (default: $QOSGATE_TARGET, else 127.0.0.1:50051)",
          "  --ca FILE          PEM CA file: TLS trusting it (default: plaintext)",
          "  --class NAME       priority class (default: the tenant's)",
          "  --deadline-ms N    deadline of each call, retries included (default 60000)",
          "  --retries N        retries of a call refused with RESOURCE_EXHAUSTED or UNAVAILABLE (default 3)",
          "  --max-tokens N     most tokens to generate (default 32)",
          "  --repeat N         run the command N times in a row (a quota's refusal and the retry show)",
          "",
          "environment: QOSGATE_API_KEY (the tenant's key, required), QOSGATE_TARGET");

  private Example() {}

  public static void main(String[] args) throws Exception {
    System.exit(run(args));
  }

  private static int run(String[] args) throws Exception {
    String target = System.getenv().getOrDefault("QOSGATE_TARGET", "127.0.0.1:50051");
    String caFile = null;
    String priorityClass = "";
    long deadlineMs = 60000;
    int retries = 3;
    int maxTokens = 32;
    long repeat = 1;
    int next = 0;
    try {
      for (; next < args.length && args[next].startsWith("--"); next += 2) {
        if (next + 1 == args.length) {
          throw new IllegalArgumentException("flag " + args[next] + " needs a value");
        }
        String value = args[next + 1];
        switch (args[next]) {
          case "--target" -> target = value;
          case "--ca" -> caFile = value;
          case "--class" -> priorityClass = value;
          case "--deadline-ms" -> deadlineMs = count(args[next], value);
          case "--retries" -> retries = (int) count(args[next], value);
          case "--max-tokens" -> maxTokens = (int) count(args[next], value);
          case "--repeat" -> repeat = count(args[next], value);
          default -> throw new IllegalArgumentException("unknown flag " + args[next]);
        }
      }
      if (repeat == 0) {
        throw new IllegalArgumentException("--repeat takes a whole number >= 1");
      }
    } catch (IllegalArgumentException bad) {
      System.err.println("error: " + bad.getMessage() + "\n" + USAGE);
      return 2;
    }
    String command = next < args.length ? args[next] : "";
    List<String> operands = Arrays.asList(args).subList(Math.min(next + 1, args.length), args.length);
    SamplingParams sampling =
        SamplingParams.newBuilder().setMaxTokens(maxTokens).setTemperature(0).build(); // greedy

    QosgateClient.Options options =
        new QosgateClient.Options()
            .target(target)
            .apiKey(System.getenv("QOSGATE_API_KEY"))
            .priorityClass(priorityClass)
            .timeout(Duration.ofMillis(deadlineMs))
            .caFile(caFile == null ? null : new File(caFile))
            .retries(retries)
            .onRetry(
                (code, wait) ->
                    System.err.printf("retrying in %.3f s after %s%n", seconds(wait), code));
    try (QosgateClient client = QosgateClient.connect(options)) {
      for (long n = 0; n < repeat; n++) {
        switch (command) {
          case "generate" -> generate(client, single(operands), sampling);
          case "stream" -> stream(client, single(operands), sampling);
          case "embed" -> embed(client, some(operands));
          case "batch" -> {
            if (operands.size() != 2) {
              throw new IllegalArgumentException("batch takes a prompt and a text");
            }
            batch(client, operands.get(0), operands.get(1), sampling);
          }
          case "infer" -> infer(client, some(operands));
          default -> throw new IllegalArgumentException("unknown command '" + command + "'");
        }
      }
    } catch (StatusRuntimeException failure) {
      report(failure);
      return 1;
    } catch (IllegalArgumentException | IOException bad) {
      System.err.println("error: " + bad.getMessage() + "\n" + USAGE);
      return 2;
    }
    return 0;
  }

  /** A flag's value as a whole number >= 0. */
  private static long count(String flag, String value) {
    try {
      long count = Long.parseLong(value);
      if (count >= 0 && count <= Integer.MAX_VALUE) {
        return count;
      }
    } catch (NumberFormatException notNumber) {
      // reported below
    }
    throw new IllegalArgumentException(flag + " takes a whole number >= 0, not '" + value + "'");
  }

  private static float number(String word) {
    try {
      return Float.parseFloat(word);
    } catch (NumberFormatException notNumber) {
      throw new IllegalArgumentException("infer takes numbers: '" + word + "' is not one");
    }
  }

  private static String single(List<String> operands) {
    if (operands.size() != 1) {
      throw new IllegalArgumentException("the command takes one argument, got " + operands.size());
    }
    return operands.get(0);
  }

  private static List<String> some(List<String> operands) {
    if (operands.isEmpty()) {
      throw new IllegalArgumentException("the command takes at least one argument");
    }
    return operands;
  }

  private static Chat chat(String prompt) {
    return Chat.newBuilder()
        .addMessages(ChatMessage.newBuilder().setRole(Role.ROLE_USER).setContent(prompt))
        .build();
  }

  private static void generate(QosgateClient client, String prompt, SamplingParams sampling) {
    GenerateResponse reply =
        client.generate(
            GenerateRequest.newBuilder()
                .setModel("smollm2")
                .setChat(chat(prompt))
                .setSampling(sampling)
                .build());
    System.out.println(reply.getText());
    System.err.printf(
        "[done] finish=%s prompt_tokens=%d completion_tokens=%d%n",
        reply.getFinishReason(),
        reply.getUsage().getPromptTokens(),
        reply.getUsage().getCompletionTokens());
  }

  private static void stream(QosgateClient client, String prompt, SamplingParams sampling) {
    GenerateStreamRequest request =
        GenerateStreamRequest.newBuilder()
            .setModel("smollm2")
            .setChat(chat(prompt))
            .setSampling(sampling)
            .build();
    GenerateStreamResponse[] last = {null};
    int[] parts = {0};
    try {
      client.generateStream(
          request,
          part -> {
            System.out.print(part.getText());
            System.out.flush(); // each delta shows as it arrives
            parts[0]++;
            last[0] = part;
          });
    } finally {
      System.out.println();
    }
    System.err.printf(
        "[done] finish=%s parts=%d prompt_tokens=%d completion_tokens=%d%n",
        last[0].getFinishReason(),
        parts[0],
        last[0].getUsage().getPromptTokens(),
        last[0].getUsage().getCompletionTokens());
  }

  private static void embed(QosgateClient client, List<String> texts) {
    EmbedResponse reply =
        client.embed(EmbedRequest.newBuilder().setModel("minilm").addAllInputs(texts).build());
    for (Embedding embedding : reply.getEmbeddingsList()) {
      StringJoiner values = new StringJoiner(" ");
      embedding.getValuesList().forEach(value -> values.add(Float.toString(value)));
      System.out.printf("%d values: %s%n", embedding.getValuesCount(), values);
    }
  }

  private static void batch(QosgateClient client, String prompt, String text, SamplingParams sampling) {
    List<BatchItem> items =
        List.of(
            BatchItem.newBuilder()
                .setCustomId("generate-1")
                .setGenerate(
                    GenerateRequest.newBuilder()
                        .setModel("smollm2")
                        .setChat(chat(prompt))
                        .setSampling(sampling))
                .build(),
            BatchItem.newBuilder()
                .setCustomId("embed-1")
                .setEmbed(EmbedRequest.newBuilder().setModel("minilm").addInputs(text))
                .build());
    Batch job =
        client.submitBatch(BatchHeader.newBuilder().setDescription("qosgate-example").build(), items);
    System.out.printf("batch %s submitted (%d items)%n", job.getId(), items.size());
    client.batchResults(
        job.getId(),
        true,
        result -> {
          switch (result.getOutcomeCase()) {
            case GENERATION -> System.out.printf(
                "%s: %s%n", result.getCustomId(), result.getGeneration().getText());
            case EMBEDDING -> System.out.printf(
                "%s: %d values%n",
                result.getCustomId(), result.getEmbedding().getEmbeddings(0).getValuesCount());
            case ERROR -> System.out.printf(
                "%s: error %s: %s%n",
                result.getCustomId(), result.getError().getCode(), result.getError().getMessage());
            default -> {}
          }
        });
    job = client.getBatch(job.getId());
    System.out.printf(
        "batch %s %s succeeded=%d failed=%d%n",
        job.getId(), job.getStatus(), job.getCounts().getSucceeded(), job.getCounts().getFailed());
  }

  private static void infer(QosgateClient client, List<String> numbers) {
    ByteBuffer raw = ByteBuffer.allocate(4 * numbers.size()).order(ByteOrder.LITTLE_ENDIAN);
    for (String word : numbers) {
      raw.putFloat(number(word));
    }
    ModelInferRequest request =
        ModelInferRequest.newBuilder()
            .setModelName("identity")
            .addInputs(
                ModelInferRequest.InferInputTensor.newBuilder()
                    .setName("INPUT0")
                    .setDatatype("FP32")
                    .addShape(1)
                    .addShape(numbers.size()))
            .addRawInputContents(ByteString.copyFrom(raw.array()))
            .build();
    ModelInferResponse reply = client.modelInfer(request);
    if (reply.getOutputsCount() != 1 || reply.getRawOutputContentsCount() != 1) {
      throw Status.INTERNAL
          .withDescription(
              "identity answered " + reply.getOutputsCount() + " outputs, "
                  + reply.getRawOutputContentsCount() + " raw contents; want 1 and 1")
          .asRuntimeException();
    }
    ByteBuffer out =
        reply.getRawOutputContents(0).asReadOnlyByteBuffer().order(ByteOrder.LITTLE_ENDIAN);
    StringJoiner values = new StringJoiner(" ");
    while (out.remaining() >= 4) {
      values.add(Float.toString(out.getFloat()));
    }
    System.out.printf(
        "%s %s: %s%n", reply.getOutputs(0).getName(), reply.getOutputs(0).getShapeList(), values);
  }

  /** Prints a failed call as "error: CODE: message", with the gateway's retry delay if any. */
  private static void report(StatusRuntimeException failure) {
    Status status = failure.getStatus();
    String line = "error: " + status.getCode() + ": " + status.getDescription();
    line += QosgateClient.retryDelay(failure)
        .map(wait -> String.format(" (retry after %.3f s)", seconds(wait)))
        .orElse("");
    System.err.println(line);
  }

  private static double seconds(Duration wait) {
    return wait.toNanos() / 1e9;
  }
}
