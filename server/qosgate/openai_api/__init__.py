"""The OpenAI-compatible HTTP API: a thin front end over the same planes as gRPC.

`wire` parses OpenAI request bodies (pydantic) into the qosgate.v1 requests the gRPC
servicers see and writes OpenAI's JSON back; `errors` maps domain errors to OpenAI's error
JSON through the one classification of `qosgate.services.status`; `batches` and `files`
put the OpenAI Batch API on the batch job store; `server` is the aiohttp app.
"""
