"""The gateway's gRPC listener: an HTTP/2 relay that moves KServe calls as frames to
Triton, not gRPC calls made.

`server.Relay` accepts tenants' HTTP/2 connections and joins each call's stream to a
stream on the upstream pool's persistent connections (upstream/connections.py), after a
per-call `policy.CallPolicy` has seen its headers and first message; calls it serves
message by message are `messages.ServerStream`s.
"""
