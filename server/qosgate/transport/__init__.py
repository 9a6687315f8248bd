"""gRPC over HTTP/2 on libnghttp2, for both ends of the gateway: the sans-I/O session
(`http2`, the one module that touches ngh2), a connection on an asyncio transport and the
flow of bytes between two (`peer`), gRPC message framing (`framing`) and whole-message
streams (`messages`), and statuses on the wire (`status`). The relay serves callers with
it (relay/), the upstream pool calls Triton with it (upstream/); nothing here knows of
either."""
