"""`qosgate-client`: generate, embed, usage and batch jobs against a qosgate gateway.

The API key comes from --api-key or the environment variable QOSGATE_API_KEY, the address
from --target or QOSGATE_TARGET (default 127.0.0.1:50051). --tls, --ca, --cert/--key
connect over TLS; a client certificate the gateway maps to a tenant replaces the key.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TextIO

from google.protobuf import json_format
from qosgate.v1 import batch_pb2, generation_pb2

from qosgate_client.batch_file import BatchFileError, check_batch_file, read_batch_items
from qosgate_client.client import DEFAULT_TARGET, Client, ClientError, TlsOptions

FINISHED = {batch_pb2.BATCH_STATUS_COMPLETED, batch_pb2.BATCH_STATUS_CANCELLED}


def _ms(duration: object) -> str:
    return f"{duration.ToTimedelta().total_seconds() * 1000:.0f} ms"  # type: ignore[attr-defined]


def _sampling(args: argparse.Namespace) -> dict[str, object]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop or (),
    }


def _generate(client: Client, args: argparse.Namespace) -> int:
    prompt, messages = None, None
    if args.raw:
        prompt = args.prompt
    else:
        messages = ([("system", args.system)] if args.system else []) + [("user", args.prompt)]
    last: generation_pb2.GenerateStreamResponse | None = None
    for message in client.generate_stream(
        args.model,
        prompt,
        messages=messages,
        priority_class=args.priority_class,
        **_sampling(args),
    ):
        sys.stdout.write(message.text)
        sys.stdout.flush()
        last = message
    sys.stdout.write("\n")
    if last is not None:
        finish = generation_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_")
        print(
            f"[usage] prompt_tokens={last.usage.prompt_tokens} "
            f"completion_tokens={last.usage.completion_tokens} finish={finish.lower()} "
            f"queue={_ms(last.timing.queue)} first_token={_ms(last.timing.time_to_first_token)} "
            f"total={_ms(last.timing.total)}",
            file=sys.stderr,
        )
    return 0


def _embed(client: Client, args: argparse.Namespace) -> int:
    response = client.embed(args.model, args.texts, priority_class=args.priority_class)
    for text, embedding in zip(args.texts, response.embeddings, strict=True):
        print(json.dumps({"input": text, "embedding": [round(v, 6) for v in embedding.values]}))
    return 0


def _usage(client: Client, args: argparse.Namespace) -> int:
    usage = client.usage(args.tenant)
    print(f"tenant {usage.tenant}, day {usage.day} (UTC)")
    for label, period in (("today", usage.today), ("this minute", usage.this_minute)):
        print(
            f"  {label:<12} requests={period.requests} prompt_tokens={period.prompt_tokens} "
            f"completion_tokens={period.completion_tokens}"
        )
    if usage.HasField("daily_token_budget"):
        print(
            f"  daily budget {usage.daily_token_budget} tokens, "
            f"{usage.remaining_daily_tokens} remaining"
        )
    if usage.HasField("tokens_per_minute"):
        print(f"  limit {usage.tokens_per_minute} tokens/minute")
    return 0


def _progress(out: TextIO, done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // total if total else width
    out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label}")
    out.flush()


def _show_batch(batch: batch_pb2.Batch) -> None:
    status = batch_pb2.BatchStatus.Name(batch.status).removeprefix("BATCH_STATUS_").lower()
    c = batch.counts
    print(
        f"{batch.id}  {status}  succeeded={c.succeeded} failed={c.failed} "
        f"cancelled={c.cancelled} total={c.total}  {batch.description}".rstrip()
    )


def _wait(client: Client, batch: batch_pb2.Batch, interval_s: float = 1.0) -> batch_pb2.Batch:
    while batch.status not in FINISHED:
        c = batch.counts
        _progress(sys.stderr, c.succeeded + c.failed + c.cancelled, c.total, "items done")
        time.sleep(interval_s)
        batch = client.get_batch(batch.id)
    c = batch.counts
    _progress(sys.stderr, c.succeeded + c.failed + c.cancelled, c.total, "items done\n")
    return batch


def _batch_submit(client: Client, args: argparse.Namespace) -> int:
    path = Path(args.file)
    total = check_batch_file(path)
    header = batch_pb2.BatchHeader(
        model=args.model or "",
        callback_url=args.callback_url or "",
        description=args.description or path.name,
    )

    def counted() -> object:
        for sent, item in enumerate(read_batch_items(path), start=1):
            if sent % 100 == 0 or sent == total:
                _progress(sys.stderr, sent, total, "items sent")
            yield item

    batch = client.create_batch(header, counted())  # type: ignore[arg-type]
    sys.stderr.write("\n")
    if args.wait:
        batch = _wait(client, batch)
    _show_batch(batch)
    return 0


def _batch_status(client: Client, args: argparse.Namespace) -> int:
    batch = client.get_batch(args.batch_id)
    if args.wait:
        batch = _wait(client, batch)
    _show_batch(batch)
    return 0


def _batch_list(client: Client, args: argparse.Namespace) -> int:
    token = ""
    while True:
        page = client.list_batches(page_size=args.page_size, page_token=token)
        for batch in page.batches:
            _show_batch(batch)
        token = page.next_page_token
        if not token or not args.all:
            return 0


def _batch_results(client: Client, args: argparse.Namespace) -> int:
    written = 0
    with contextlib.ExitStack() as stack:
        out: IO[str] = sys.stdout
        if args.out:
            # Resuming from an offset appends to what an earlier run wrote.
            mode = "a" if args.offset else "w"
            out = stack.enter_context(open(args.out, mode, encoding="utf-8"))
        for result in client.batch_results(args.batch_id, offset=args.offset, follow=args.follow):
            out.write(
                json_format.MessageToJson(result, preserving_proto_field_name=True, indent=None)
                + "\n"
            )
            written += 1
    if args.out:
        print(f"{written} result(s) written to {args.out}", file=sys.stderr)
    return 0


def _batch_cancel(client: Client, args: argparse.Namespace) -> int:
    _show_batch(client.cancel_batch(args.batch_id))
    return 0


def _add_sampling(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, help="upper bound on generated tokens")
    parser.add_argument("--temperature", type=float, help="0 = greedy")
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qosgate-client", description=__doc__)
    parser.add_argument(
        "--target", default=os.environ.get("QOSGATE_TARGET", DEFAULT_TARGET), help="host:port"
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("QOSGATE_API_KEY"), help="default: $QOSGATE_API_KEY"
    )
    parser.add_argument("--timeout", type=float, help="per-call deadline in seconds")
    tls = parser.add_argument_group("TLS (any of these connects over TLS)")
    tls.add_argument("--tls", action="store_true", help="TLS, trusting the system's CA roots")
    tls.add_argument("--ca", metavar="FILE", help="PEM CA certificates to verify the gateway with")
    tls.add_argument("--cert", metavar="FILE", help="PEM client certificate (mutual TLS)")
    tls.add_argument("--key", metavar="FILE", help="PEM private key of --cert")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a completion to the terminal, then usage")
    gen.add_argument("prompt")
    gen.add_argument("--model", required=True)
    gen.add_argument("--class", dest="priority_class", help="priority class (default: tenant's)")
    gen.add_argument("--system", help="system message for the chat template")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    _add_sampling(gen)
    gen.set_defaults(func=_generate)

    emb = sub.add_parser("embed", help="print one JSON line with the vector per text")
    emb.add_argument("texts", nargs="+")
    emb.add_argument("--model", required=True)
    emb.add_argument("--class", dest="priority_class")
    emb.set_defaults(func=_embed)

    use = sub.add_parser("usage", help="token usage today and this minute, remaining budget")
    use.add_argument("--tenant", help="another tenant (needs an admin key)")
    use.set_defaults(func=_usage)

    batch = sub.add_parser("batch", help="batch jobs").add_subparsers(dest="action", required=True)
    submit = batch.add_parser("submit", help="submit a JSONL file of BatchItem lines")
    submit.add_argument("file")
    submit.add_argument("--model", help="model for items that name none")
    submit.add_argument("--callback-url", help="POSTed the job when it ends (allowlisted)")
    submit.add_argument("--description")
    submit.add_argument("--wait", action="store_true", help="show progress until the job ends")
    submit.set_defaults(func=_batch_submit)
    status = batch.add_parser("status", help="a job's status and counts")
    status.add_argument("batch_id")
    status.add_argument("--wait", action="store_true", help="show progress until the job ends")
    status.set_defaults(func=_batch_status)
    listing = batch.add_parser("list", help="your jobs, newest first")
    listing.add_argument("--page-size", type=int, default=20)
    listing.add_argument("--all", action="store_true", help="follow every page")
    listing.set_defaults(func=_batch_list)
    results = batch.add_parser("results", help="results as JSON lines, completion order")
    results.add_argument("batch_id")
    results.add_argument("--out", help="file to write (default: stdout)")
    results.add_argument("--offset", type=int, default=0, help="skip this many (resume)")
    results.add_argument("--follow", action="store_true", help="wait until the job ends")
    results.set_defaults(func=_batch_results)
    cancel = batch.add_parser("cancel", help="stop dispatching a job's remaining items")
    cancel.add_argument("batch_id")
    cancel.set_defaults(func=_batch_cancel)
    return parser


def _tls(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TlsOptions | None:
    if not (args.tls or args.ca or args.cert or args.key):
        return None
    try:
        return TlsOptions(ca_file=args.ca, cert_file=args.cert, key_file=args.key)
    except ValueError as error:
        parser.error(f"--cert/--key: {error}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[Client, argparse.Namespace], int] = args.func
    try:
        client = Client(args.target, args.api_key, timeout_s=args.timeout, tls=_tls(parser, args))
    except OSError as error:  # a TLS file that cannot be read
        print(f"error: {error.filename}: {error.strerror}", file=sys.stderr)
        return 2
    try:
        with client:
            return handler(client, args)
    except ClientError as error:
        retry = f" (retry after {error.retry_after_s:.1f} s)" if error.retry_after_s else ""
        print(f"\nerror: {error.code}: {error.message}{retry}", file=sys.stderr)
        return 1
    except BatchFileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
