"""The KServe data path as an HTTP/2 relay: gRPC frames moved, not gRPC calls made.

`server.Relay` accepts tenants' HTTP/2 connections and joins each call's stream to a
stream on a few persistent connections per upstream (`upstream.UpstreamPool`), after a
per-call `policy.CallPolicy` has seen its headers and first message. `http2` is the only
module that touches the HTTP/2 library (ngh2 on libnghttp2).
"""
