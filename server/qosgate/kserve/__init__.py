"""KServe v2, Triton's gRPC protocol, as the gateway speaks it: the service's names, the
request headers the gateway reads, and just enough of the protobuf wire format to route
inference messages as bytes (`wire`)."""
