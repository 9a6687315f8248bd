// Package qosgate calls a qosgate gateway: its qosgate.v1 API (generation, embeddings,
// batch jobs) and the KServe v2 protocol it relays to Triton, over stubs generated from
// protos/ and from tritonclient's descriptors at build time (see ../README.md).
//
// A Client adds what every caller would otherwise write by hand: the API key in the call
// metadata, a default priority class and deadline, TLS with a CA file, and a retry of calls
// refused with RESOURCE_EXHAUSTED or UNAVAILABLE that waits as long as the gateway's
// google.rpc.RetryInfo says.
package qosgate

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/golang/protobuf/ptypes"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/qosgate/qosgate/gen/go/inference"
	v1 "github.com/qosgate/qosgate/gen/go/qosgate/v1"
)

// PriorityHeader carries the priority class of KServe calls, whose requests have no field
// for it (qosgate.v1 requests carry it in priority_class).
const PriorityHeader = "x-priority"

// Options says how a Client reaches the gateway and on whose behalf.
type Options struct {
	// Target is the gateway's address, host:port.
	Target string
	// APIKey is the tenant's key, sent as "authorization: Bearer <key>" on every call.
	APIKey string
	// PriorityClass, when set, is the class of every call that names none.
	PriorityClass string
	// Timeout bounds each call, its retries included, when the caller's context has no
	// deadline; zero leaves calls unbounded.
	Timeout time.Duration
	// CAFile, when set, turns on TLS trusting the PEM certificates in it; plaintext
	// otherwise.
	CAFile string
	// Retries is how many times a call refused with RESOURCE_EXHAUSTED or UNAVAILABLE is
	// tried again. A stream is retried only when it failed before its first message.
	Retries int
	// OnRetry, when set, is told the refusal's code and the wait before each retry.
	OnRetry func(code codes.Code, wait time.Duration)
}

// Client is a connection to the gateway for one tenant; safe for concurrent use.
type Client struct {
	opts       Options
	conn       *grpc.ClientConn
	generation v1.GenerationServiceClient
	embedding  v1.EmbeddingServiceClient
	batch      v1.BatchServiceClient
	inference  inference.GRPCInferenceServiceClient
}

// Dial checks the options and connects (lazily: the first call dials).
func Dial(opts Options) (*Client, error) {
	if opts.Target == "" {
		return nil, errors.New("qosgate: Options.Target is empty (want host:port)")
	}
	if opts.APIKey == "" {
		return nil, errors.New("qosgate: Options.APIKey is empty")
	}
	if opts.Retries < 0 || opts.Timeout < 0 {
		return nil, errors.New("qosgate: Options.Retries and Options.Timeout must not be negative")
	}
	security := grpc.WithInsecure()
	if opts.CAFile != "" {
		pem, err := os.ReadFile(opts.CAFile)
		if err != nil {
			return nil, fmt.Errorf("qosgate: reading the CA file: %w", err)
		}
		roots := x509.NewCertPool()
		if !roots.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("qosgate: no PEM certificate in the CA file %s", opts.CAFile)
		}
		security = grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: roots}))
	}
	conn, err := grpc.Dial(opts.Target, security)
	if err != nil {
		return nil, fmt.Errorf("qosgate: %w", err)
	}
	return &Client{
		opts:       opts,
		conn:       conn,
		generation: v1.NewGenerationServiceClient(conn),
		embedding:  v1.NewEmbeddingServiceClient(conn),
		batch:      v1.NewBatchServiceClient(conn),
		inference:  inference.NewGRPCInferenceServiceClient(conn),
	}, nil
}

// Close closes the connection.
func (c *Client) Close() error { return c.conn.Close() }

// Generate returns a whole completion.
func (c *Client) Generate(ctx context.Context, req *v1.GenerateRequest) (*v1.GenerateResponse, error) {
	if req.PriorityClass == "" && c.opts.PriorityClass != "" {
		req = proto.Clone(req).(*v1.GenerateRequest)
		req.PriorityClass = c.opts.PriorityClass
	}
	var reply *v1.GenerateResponse
	err := c.call(ctx, func(ctx context.Context) (bool, error) {
		var err error
		reply, err = c.generation.Generate(ctx, req)
		return false, err
	})
	return reply, err
}

// GenerateStream streams a completion, handing each message to onPart as it arrives; the
// last one carries the finish reason, usage and timing. An error from onPart cancels the
// call (which stops generation in the engine) and is returned.
func (c *Client) GenerateStream(ctx context.Context, req *v1.GenerateStreamRequest, onPart func(*v1.GenerateStreamResponse) error) error {
	if req.PriorityClass == "" && c.opts.PriorityClass != "" {
		req = proto.Clone(req).(*v1.GenerateStreamRequest)
		req.PriorityClass = c.opts.PriorityClass
	}
	return c.call(ctx, func(ctx context.Context) (bool, error) {
		stream, err := c.generation.GenerateStream(ctx, req)
		if err != nil {
			return false, err
		}
		return receive(stream.Recv, onPart)
	})
}

// Embed returns one vector per input text, in order.
func (c *Client) Embed(ctx context.Context, req *v1.EmbedRequest) (*v1.EmbedResponse, error) {
	if req.PriorityClass == "" && c.opts.PriorityClass != "" {
		req = proto.Clone(req).(*v1.EmbedRequest)
		req.PriorityClass = c.opts.PriorityClass
	}
	var reply *v1.EmbedResponse
	err := c.call(ctx, func(ctx context.Context) (bool, error) {
		var err error
		reply, err = c.embedding.Embed(ctx, req)
		return false, err
	})
	return reply, err
}

// SubmitBatch creates a batch job: the header, then the items in one chunk. The gateway
// queues the job only once every item is valid, so a refused submission is retried whole.
func (c *Client) SubmitBatch(ctx context.Context, header *v1.BatchHeader, items []*v1.BatchItem) (*v1.Batch, error) {
	var reply *v1.CreateBatchResponse
	err := c.call(ctx, func(ctx context.Context) (bool, error) {
		stream, err := c.batch.CreateBatch(ctx)
		if err != nil {
			return false, err
		}
		chunks := []*v1.CreateBatchRequest{
			{Chunk: &v1.CreateBatchRequest_Header{Header: header}},
			{Chunk: &v1.CreateBatchRequest_Items{Items: &v1.BatchItems{Items: items}}},
		}
		for _, chunk := range chunks {
			// On a refusal Send returns io.EOF; CloseAndRecv then returns the status.
			if err := stream.Send(chunk); err != nil && err != io.EOF {
				return false, err
			}
		}
		reply, err = stream.CloseAndRecv()
		return false, err
	})
	if err != nil {
		return nil, err
	}
	return reply.Batch, nil
}

// GetBatch returns a job's status and counts.
func (c *Client) GetBatch(ctx context.Context, batchID string) (*v1.Batch, error) {
	var reply *v1.GetBatchResponse
	err := c.call(ctx, func(ctx context.Context) (bool, error) {
		var err error
		reply, err = c.batch.GetBatch(ctx, &v1.GetBatchRequest{BatchId: batchID})
		return false, err
	})
	if err != nil {
		return nil, err
	}
	return reply.Batch, nil
}

// BatchResults hands a job's results to onResult in completion order; with follow it
// waits for results still to come until the job ends.
func (c *Client) BatchResults(ctx context.Context, batchID string, follow bool, onResult func(*v1.StreamBatchResultsResponse) error) error {
	req := &v1.StreamBatchResultsRequest{BatchId: batchID, Follow: follow}
	return c.call(ctx, func(ctx context.Context) (bool, error) {
		stream, err := c.batch.StreamBatchResults(ctx, req)
		if err != nil {
			return false, err
		}
		return receive(stream.Recv, onResult)
	})
}

// ModelInfer runs a KServe v2 inference through the gateway (the model's tenant rules,
// quotas and scheduling apply as to any call).
func (c *Client) ModelInfer(ctx context.Context, req *inference.ModelInferRequest) (*inference.ModelInferResponse, error) {
	var reply *inference.ModelInferResponse
	err := c.call(ctx, func(ctx context.Context) (bool, error) {
		if c.opts.PriorityClass != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, PriorityHeader, c.opts.PriorityClass)
		}
		var err error
		reply, err = c.inference.ModelInfer(ctx, req)
		return false, err
	})
	return reply, err
}

// receive hands a stream's messages to handle until it ends; it reports whether any
// message was handed over, after which the call is not retried.
func receive[T any](recv func() (T, error), handle func(T) error) (bool, error) {
	handed := false
	for {
		message, err := recv()
		if err == io.EOF {
			return handed, nil
		}
		if err != nil {
			return handed, err
		}
		handed = true
		if err := handle(message); err != nil {
			return true, err
		}
	}
}

// call runs attempt with the key in its metadata and the default deadline, again after a
// retryable refusal while retries and the deadline allow. attempt reports whether it
// delivered anything to the caller, which rules a retry out.
func (c *Client) call(ctx context.Context, attempt func(context.Context) (bool, error)) error {
	if _, bounded := ctx.Deadline(); !bounded && c.opts.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.opts.Timeout)
		defer cancel()
	}
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.opts.APIKey)
	for tried := 0; ; tried++ {
		delivered, err := attempt(ctx)
		code := status.Code(err)
		if err == nil || delivered || tried == c.opts.Retries || (code != codes.ResourceExhausted && code != codes.Unavailable) {
			return err
		}
		wait, told := RetryDelay(err)
		if !told {
			wait = fallbackDelay(tried)
		}
		if deadline, bounded := ctx.Deadline(); bounded && time.Until(deadline) < wait {
			return err // the retry could not finish in time
		}
		if c.opts.OnRetry != nil {
			c.opts.OnRetry(code, wait)
		}
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return err
		}
	}
}

// fallbackDelay is the wait before retry n+1 of a refusal without RetryInfo (UNAVAILABLE
// from a connection that failed): 100 ms, doubling, at most 5 s.
func fallbackDelay(n int) time.Duration {
	if n > 5 {
		return 5 * time.Second
	}
	return 100 * time.Millisecond << n
}

// RetryDelay is the wait the gateway asked for in the error's google.rpc.RetryInfo, and
// whether there was one.
func RetryDelay(err error) (time.Duration, bool) {
	for _, any := range status.Convert(err).Proto().GetDetails() {
		info := &errdetails.RetryInfo{}
		if ptypes.Is(any, info) && ptypes.UnmarshalAny(any, info) == nil {
			delay, err := ptypes.Duration(info.GetRetryDelay())
			return delay, err == nil
		}
	}
	return 0, false
}
