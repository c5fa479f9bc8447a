// epp-pick asks an Endpoint Picker which endpoint it would send requests to, the way a gateway does: one ext-proc
// stream per request (request headers, then the JSON body), read back from the picker's header mutation.
// Each line of stdin is one request body; each line of stdout is the endpoint picked for it, or "error STATUS"
// when the picker answered with an immediate response instead.
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

const destinationHeader = "x-gateway-destination-endpoint"

func pick(ctx context.Context, client extproc.ExternalProcessorClient, body []byte) (string, error) {
	stream, err := client.Process(ctx)
	if err != nil {
		return "", err
	}
	defer func() { _ = stream.CloseSend() }()
	headers := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte("POST")},
		{Key: ":path", RawValue: []byte("/v1/completions")},
		{Key: "content-type", RawValue: []byte("application/json")},
	}}
	if err := stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extproc.HttpHeaders{Headers: headers}}}); err != nil {
		return "", err
	}
	if err := stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestBody{
		RequestBody: &extproc.HttpBody{Body: body, EndOfStream: true}}}); err != nil {
		return "", err
	}
	for {
		resp, err := stream.Recv()
		if err != nil {
			return "", err
		}
		if imm := resp.GetImmediateResponse(); imm != nil {
			return fmt.Sprintf("error %d", imm.GetStatus().GetCode()), nil
		}
		for _, h := range resp.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
			if h.GetHeader().GetKey() == destinationHeader {
				return string(h.GetHeader().GetRawValue()), nil
			}
		}
	}
}

func main() {
	addr := flag.String("addr", "127.0.0.1:9002", "the picker's ext-proc gRPC address")
	timeout := flag.Duration("timeout", 10*time.Second, "time allowed for each pick")
	flag.Parse()
	conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, "epp-pick:", err)
		os.Exit(2)
	}
	defer conn.Close()
	client := extproc.NewExternalProcessorClient(conn)
	lines := bufio.NewScanner(os.Stdin)
	lines.Buffer(make([]byte, 1<<20), 1<<24)
	for lines.Scan() {
		ctx, cancel := context.WithTimeout(context.Background(), *timeout)
		endpoint, err := pick(ctx, client, lines.Bytes())
		cancel()
		if err != nil {
			fmt.Fprintln(os.Stderr, "epp-pick:", err)
			os.Exit(1)
		}
		fmt.Println(endpoint)
	}
}
