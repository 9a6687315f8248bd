// Command qosgate-example calls a qosgate gateway through the qosgate library: unary and
// streamed generation, embeddings, a batch job and a KServe ModelInfer on the identity
// model. The address comes from --target or QOSGATE_TARGET, the key from QOSGATE_API_KEY
// only (a flag would show it in the process list). See ../../README.md.
package main

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/qosgate/qosgate/clients/go/qosgate"
	"github.com/qosgate/qosgate/gen/go/inference"
	v1 "github.com/qosgate/qosgate/gen/go/qosgate/v1"
)

const usage = `usage: qosgate-example [flags] COMMAND ARG...

commands:
  generate PROMPT   unary Generate on smollm2; prints the answer
  stream PROMPT     GenerateStream on smollm2; prints the text as it arrives
  embed TEXT...     Embed on minilm; one line per text: its dimension and values
  batch PROMPT TEXT a batch job with one generation and one embedding; prints its results
  infer NUMBER...   KServe ModelInfer on identity (FP32, shape [1, N]); prints OUTPUT0

environment: QOSGATE_API_KEY (the tenant's key, required), QOSGATE_TARGET

flags:
`

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	flags := flag.NewFlagSet("qosgate-example", flag.ContinueOnError)
	flags.Usage = func() {
		fmt.Fprint(os.Stderr, usage)
		flags.PrintDefaults()
	}
	target := flags.String("target", envOr("QOSGATE_TARGET", "127.0.0.1:50051"), "gateway address (default: $QOSGATE_TARGET)")
	caFile := flags.String("ca", "", "PEM CA file: TLS trusting it (default: plaintext)")
	class := flags.String("class", "", "priority class (default: the tenant's)")
	deadlineMs := flags.Int("deadline-ms", 60000, "deadline of each call, retries included")
	retries := flags.Int("retries", 3, "retries of a call refused with RESOURCE_EXHAUSTED or UNAVAILABLE")
	maxTokens := flags.Uint("max-tokens", 32, "most tokens to generate")
	repeat := flags.Uint("repeat", 1, "run the command this many times in a row (a quota's refusal and the retry show)")
	if err := flags.Parse(args); err != nil {
		return 2
	}
	if flags.NArg() == 0 {
		flags.Usage()
		return 2
	}
	if *repeat == 0 {
		return misuse(flags, "--repeat takes a whole number >= 1")
	}
	client, err := qosgate.Dial(qosgate.Options{
		Target:        *target,
		APIKey:        os.Getenv("QOSGATE_API_KEY"),
		PriorityClass: *class,
		Timeout:       time.Duration(*deadlineMs) * time.Millisecond,
		CAFile:        *caFile,
		Retries:       *retries,
		OnRetry: func(code codes.Code, wait time.Duration) {
			fmt.Fprintf(os.Stderr, "retrying in %.3f s after %s\n", wait.Seconds(), codeName(code))
		},
	})
	if err != nil {
		return misuse(flags, err.Error())
	}
	defer client.Close()
	sampling := &v1.SamplingParams{MaxTokens: proto32(uint32(*maxTokens)), Temperature: new(float32)} // greedy
	command, operands := flags.Arg(0), flags.Args()[1:]
	ctx := context.Background()
	for n := uint(0); n < *repeat && err == nil; n++ {
		switch {
		case command == "generate" && len(operands) == 1:
			err = generate(ctx, client, operands[0], sampling)
		case command == "stream" && len(operands) == 1:
			err = stream(ctx, client, operands[0], sampling)
		case command == "embed" && len(operands) > 0:
			err = embed(ctx, client, operands)
		case command == "batch" && len(operands) == 2:
			err = batch(ctx, client, operands[0], operands[1], sampling)
		case command == "infer" && len(operands) > 0:
			values, bad := numbers(operands)
			if bad != nil {
				return misuse(flags, bad.Error())
			}
			err = infer(ctx, client, values)
		default:
			return misuse(flags, "unknown command or wrong arguments: "+strings.Join(flags.Args(), " "))
		}
	}
	if err != nil {
		report(err)
		return 1
	}
	return 0
}

// misuse reports a mistake in the command line; exit status 2.
func misuse(flags *flag.FlagSet, problem string) int {
	fmt.Fprintf(os.Stderr, "error: %s\n", problem)
	flags.Usage()
	return 2
}

func numbers(words []string) ([]float32, error) {
	values := make([]float32, len(words))
	for i, word := range words {
		value, err := strconv.ParseFloat(word, 32)
		if err != nil {
			return nil, fmt.Errorf("infer takes numbers: %q is not one", word)
		}
		values[i] = float32(value)
	}
	return values, nil
}

func chat(prompt string) *v1.Chat {
	return &v1.Chat{Messages: []*v1.ChatMessage{{Role: v1.Role_ROLE_USER, Content: prompt}}}
}

func generate(ctx context.Context, client *qosgate.Client, prompt string, sampling *v1.SamplingParams) error {
	reply, err := client.Generate(ctx, &v1.GenerateRequest{
		Model: "smollm2", Input: &v1.GenerateRequest_Chat{Chat: chat(prompt)}, Sampling: sampling,
	})
	if err != nil {
		return err
	}
	fmt.Println(reply.Text)
	fmt.Fprintf(os.Stderr, "[done] finish=%s prompt_tokens=%d completion_tokens=%d\n",
		reply.FinishReason, reply.Usage.GetPromptTokens(), reply.Usage.GetCompletionTokens())
	return nil
}

func stream(ctx context.Context, client *qosgate.Client, prompt string, sampling *v1.SamplingParams) error {
	request := &v1.GenerateStreamRequest{
		Model: "smollm2", Input: &v1.GenerateStreamRequest_Chat{Chat: chat(prompt)}, Sampling: sampling,
	}
	parts := 0
	var last *v1.GenerateStreamResponse
	err := client.GenerateStream(ctx, request, func(part *v1.GenerateStreamResponse) error {
		fmt.Print(part.Text) // stdout is unbuffered: each delta shows as it arrives
		parts, last = parts+1, part
		return nil
	})
	fmt.Println()
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "[done] finish=%s parts=%d prompt_tokens=%d completion_tokens=%d\n",
		last.GetFinishReason(), parts, last.GetUsage().GetPromptTokens(), last.GetUsage().GetCompletionTokens())
	return nil
}

func embed(ctx context.Context, client *qosgate.Client, texts []string) error {
	reply, err := client.Embed(ctx, &v1.EmbedRequest{Model: "minilm", Inputs: texts})
	if err != nil {
		return err
	}
	for _, embedding := range reply.Embeddings {
		fmt.Printf("%d values: %s\n", len(embedding.Values), floats(embedding.Values))
	}
	return nil
}

func batch(ctx context.Context, client *qosgate.Client, prompt, text string, sampling *v1.SamplingParams) error {
	items := []*v1.BatchItem{
		{CustomId: "generate-1", Request: &v1.BatchItem_Generate{Generate: &v1.GenerateRequest{
			Model: "smollm2", Input: &v1.GenerateRequest_Chat{Chat: chat(prompt)}, Sampling: sampling,
		}}},
		{CustomId: "embed-1", Request: &v1.BatchItem_Embed{Embed: &v1.EmbedRequest{Model: "minilm", Inputs: []string{text}}}},
	}
	job, err := client.SubmitBatch(ctx, &v1.BatchHeader{Description: "qosgate-example"}, items)
	if err != nil {
		return err
	}
	fmt.Printf("batch %s submitted (%d items)\n", job.Id, len(items))
	err = client.BatchResults(ctx, job.Id, true, func(result *v1.StreamBatchResultsResponse) error {
		switch outcome := result.Outcome.(type) {
		case *v1.StreamBatchResultsResponse_Generation:
			fmt.Printf("%s: %s\n", result.CustomId, outcome.Generation.Text)
		case *v1.StreamBatchResultsResponse_Embedding:
			fmt.Printf("%s: %d values\n", result.CustomId, len(outcome.Embedding.Embeddings[0].GetValues()))
		case *v1.StreamBatchResultsResponse_Error:
			fmt.Printf("%s: error %s: %s\n", result.CustomId, outcome.Error.Code, outcome.Error.Message)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if job, err = client.GetBatch(ctx, job.Id); err != nil {
		return err
	}
	fmt.Printf("batch %s %s succeeded=%d failed=%d\n", job.Id, job.Status, job.Counts.GetSucceeded(), job.Counts.GetFailed())
	return nil
}

func infer(ctx context.Context, client *qosgate.Client, values []float32) error {
	raw := make([]byte, 4*len(values)) // KServe's raw tensors are little-endian
	for i, value := range values {
		binary.LittleEndian.PutUint32(raw[4*i:], math.Float32bits(value))
	}
	reply, err := client.ModelInfer(ctx, &inference.ModelInferRequest{
		ModelName: "identity",
		Inputs: []*inference.ModelInferRequest_InferInputTensor{
			{Name: "INPUT0", Datatype: "FP32", Shape: []int64{1, int64(len(values))}},
		},
		RawInputContents: [][]byte{raw},
	})
	if err != nil {
		return err
	}
	if len(reply.Outputs) != 1 || len(reply.RawOutputContents) != 1 {
		return fmt.Errorf("identity answered %d outputs, %d raw contents; want 1 and 1", len(reply.Outputs), len(reply.RawOutputContents))
	}
	out := reply.RawOutputContents[0]
	echoed := make([]float32, len(out)/4)
	for i := range echoed {
		echoed[i] = math.Float32frombits(binary.LittleEndian.Uint32(out[4*i:]))
	}
	fmt.Printf("%s %v: %s\n", reply.Outputs[0].Name, reply.Outputs[0].Shape, floats(echoed))
	return nil
}

// report prints a failed call as "error: CODE: message", with the gateway's retry delay
// when it sent one.
func report(err error) {
	s, isStatus := status.FromError(err)
	if !isStatus {
		fmt.Fprintf(os.Stderr, "error: %v\n", err)
		return
	}
	line := fmt.Sprintf("error: %s: %s", codeName(s.Code()), s.Message())
	if wait, told := qosgate.RetryDelay(err); told {
		line += fmt.Sprintf(" (retry after %.3f s)", wait.Seconds())
	}
	fmt.Fprintln(os.Stderr, line)
}

// codeNames spells the codes as the gRPC specification does (RESOURCE_EXHAUSTED), as
// the other languages' examples print them; Go's own names are CamelCase.
var codeNames = [...]string{
	"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
	"ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
	"ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
	"UNAUTHENTICATED",
}

func codeName(code codes.Code) string {
	if int(code) < len(codeNames) {
		return codeNames[code]
	}
	return code.String()
}

func floats(values []float32) string {
	words := make([]string, len(values))
	for i, v := range values {
		words[i] = strconv.FormatFloat(float64(v), 'g', -1, 32)
	}
	return strings.Join(words, " ")
}

func envOr(name, fallback string) string {
	if value := os.Getenv(name); value != "" {
		return value
	}
	return fallback
}

func proto32(v uint32) *uint32 { return &v }
