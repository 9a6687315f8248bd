"""TLS and mutual TLS with real certificates made at test time, through real channels:
tritonclient (`ssl=True` and its certificate options), perf_analyzer (`--ssl-grpc-*`), the
qosgate Python client and CLI, the Node client, the official openai SDK on the OpenAI
listener (the same `tls:`), the plaintext health endpoints that probes read while the
listeners speak TLS, and the gateway reaching a Triton that requires TLS.

The PKI: one CA issues the gateway's server certificate (127.0.0.1/localhost) and the
clients' certificates: acme's is mapped by its SAN, globex's by its SHA-256 fingerprint,
a stranger's by nothing. A rogue CA stands for everything the gateway must not trust.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
from certificates import CertificateAuthority, Issued
from tritonclient.utils import InferenceServerException

from conftest import free_port, require_model, started_then_killed
from gateway_harness import ACME_KEY, GLOBEX_KEY, GatewayThread, bearer, gateway_config
from qosgate import paths
from qosgate.launcher import LocalTriton, TritonPorts
from qosgate_client import Client, ClientError, TlsOptions

pytestmark = pytest.mark.integration

ACME_SAN = "spiffe://qosgate.test/acme"
PERF_ANALYZER = paths.cache_dir() / "tools" / "perf_analyzer"
CLI = Path(sys.executable).parent / "qosgate-client"
NODE_CLIENT = paths.project_root() / "clients" / "node" / "qosgate.js"


@dataclasses.dataclass(frozen=True)
class Pki:
    ca: CertificateAuthority
    server: Issued
    acme: Issued
    globex: Issued
    stranger: Issued
    rogue_ca: CertificateAuthority
    rogue_acme: Issued


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority(directory, "qosgate")
    rogue = CertificateAuthority(directory, "rogue")
    return Pki(
        ca=ca,
        server=ca.server(),
        acme=ca.client("acme", uri=ACME_SAN),
        globex=ca.client("globex"),
        stranger=ca.client("stranger"),
        rogue_ca=rogue,
        # Same SAN as acme's real certificate: only the CA tells them apart.
        rogue_acme=rogue.client("rogue-acme", uri=ACME_SAN),
    )


def tenants(pki: Pki) -> list[dict[str, Any]]:
    return [
        {
            "name": "acme",
            "api_keys": [{"key": ACME_KEY}],
            "client_certs": [{"san": ACME_SAN}],
        },
        {
            "name": "globex",
            "api_keys": [{"key": GLOBEX_KEY}],
            "models": ["identity"],
            "client_certs": [{"sha256": pki.globex.fingerprint}],
        },
    ]


@pytest.fixture(scope="module")
def tls_gateway(triton: LocalTriton, pki: Pki) -> Iterator[GatewayThread]:
    """Server-only TLS: tenants identify with API keys."""
    tls = {"cert": str(pki.server.cert), "key": str(pki.server.key)}
    with GatewayThread(gateway_config(triton.ports.grpc_url, tls=tls)) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def mtls_gateway(triton: LocalTriton, pki: Pki) -> Iterator[GatewayThread]:
    """Mutual TLS: every client presents a certificate from the CA; acme and globex are
    identified by theirs."""
    tls = {"cert": str(pki.server.cert), "key": str(pki.server.key), "client_ca": str(pki.ca.cert)}
    with GatewayThread(gateway_config(triton.ports.grpc_url, tls=tls, tenants=tenants(pki))) as gateway:
        yield gateway


def tritonclient(url: str, ca: Path | None, client: Issued | None = None) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(
        url,
        ssl=True,
        root_certificates=str(ca) if ca else None,
        private_key=str(client.key) if client else None,
        certificate_chain=str(client.cert) if client else None,
    )


def infer_identity(client: grpcclient.InferenceServerClient, headers: dict[str, str] | None = None) -> None:
    data = np.array([[1.0, 2.5, -3.0]], dtype=np.float32)
    tensor = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    result = client.infer("identity", [tensor], headers=headers, client_timeout=30)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)


def refused(client: grpcclient.InferenceServerClient, headers: dict[str, str] | None = None) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        infer_identity(client, headers)
    return caught.value


# -- server-only TLS ---------------------------------------------------------------------


def test_tritonclient_over_tls_with_an_api_key(tls_gateway: GatewayThread, pki: Pki) -> None:
    require_model("identity")
    port = tls_gateway.gateway.port
    for url in (f"127.0.0.1:{port}", f"localhost:{port}"):  # both names are in the certificate
        with tritonclient(url, pki.ca.cert) as client:
            infer_identity(client, bearer(ACME_KEY))
            assert refused(client).status() == "StatusCode.UNAUTHENTICATED"


def test_a_plaintext_client_gets_nothing_from_a_tls_listener(tls_gateway: GatewayThread) -> None:
    require_model("identity")
    with grpcclient.InferenceServerClient(tls_gateway.url) as client:
        assert refused(client, bearer(ACME_KEY)).status() == "StatusCode.UNAVAILABLE"


def test_a_client_trusting_another_ca_refuses_the_gateway(tls_gateway: GatewayThread, pki: Pki) -> None:
    require_model("identity")
    with tritonclient(tls_gateway.url, pki.rogue_ca.cert) as client:
        assert refused(client, bearer(ACME_KEY)).status() == "StatusCode.UNAVAILABLE"


# -- mutual TLS --------------------------------------------------------------------------


def test_mtls_client_certificate_identifies_the_tenant(mtls_gateway: GatewayThread, pki: Pki) -> None:
    require_model("identity")
    with tritonclient(mtls_gateway.url, pki.ca.cert, pki.acme) as client:  # by SAN
        infer_identity(client)
    with tritonclient(mtls_gateway.url, pki.ca.cert, pki.globex) as client:  # by fingerprint
        infer_identity(client)
        infer_identity(client, bearer(GLOBEX_KEY))  # the same tenant twice: fine
        # Served as globex, whose models are ["identity"] only.
        with pytest.raises(InferenceServerException, match="tenant 'globex' may not use model 'minilm'"):
            client.get_model_metadata("minilm")


def test_mtls_certificate_and_key_of_different_tenants_is_unauthenticated(
    mtls_gateway: GatewayThread, pki: Pki
) -> None:
    require_model("identity")
    with tritonclient(mtls_gateway.url, pki.ca.cert, pki.acme) as client:
        error = refused(client, bearer(GLOBEX_KEY))
    assert error.status() == "StatusCode.UNAUTHENTICATED"
    assert "identify different tenants" in error.message()


def test_mtls_unmapped_certificate_needs_a_key(mtls_gateway: GatewayThread, pki: Pki) -> None:
    require_model("identity")
    with tritonclient(mtls_gateway.url, pki.ca.cert, pki.stranger) as client:
        infer_identity(client, bearer(ACME_KEY))
        error = refused(client)
    assert error.status() == "StatusCode.UNAUTHENTICATED"
    assert "the client certificate identifies no tenant" in error.message()


def test_a_caller_cannot_pass_itself_off_as_another_certificate(mtls_gateway: GatewayThread, pki: Pki) -> None:
    """The relay hands the verified certificate to the gateway's grpcio server in headers;
    the same headers sent by a caller identify nobody, on the relayed ModelInfer or on a
    call the relay hands on."""
    require_model("identity")
    forged = {"qosgate-peer-cert-sha256": pki.globex.fingerprint, "qosgate-peer-cert-san": ACME_SAN}
    with tritonclient(mtls_gateway.url, pki.ca.cert, pki.stranger) as client:
        assert refused(client, forged).status() == "StatusCode.UNAUTHENTICATED"
        with pytest.raises(InferenceServerException) as caught:
            client.get_model_metadata("identity", headers=forged)
        assert caught.value.status() == "StatusCode.UNAUTHENTICATED"


def test_mtls_refuses_clients_without_a_certificate_from_its_ca(mtls_gateway: GatewayThread, pki: Pki) -> None:
    require_model("identity")
    # No client certificate at all, even with a valid key: the handshake fails.
    with tritonclient(mtls_gateway.url, pki.ca.cert) as client:
        assert refused(client, bearer(ACME_KEY)).status() == "StatusCode.UNAVAILABLE"
    # A certificate with acme's SAN from a CA the gateway does not trust.
    with tritonclient(mtls_gateway.url, pki.ca.cert, pki.rogue_acme) as client:
        assert refused(client).status() == "StatusCode.UNAVAILABLE"


def test_no_key_material_reaches_the_log(
    triton: LocalTriton, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    require_model("identity")
    caplog.set_level(logging.DEBUG)
    tls = {"cert": str(pki.server.cert), "key": str(pki.server.key), "client_ca": str(pki.ca.cert)}
    with GatewayThread(gateway_config(triton.ports.grpc_url, tls=tls, tenants=tenants(pki))) as gateway:
        with tritonclient(gateway.url, pki.ca.cert, pki.acme) as client:
            infer_identity(client)
            refused(client, bearer("s3cret-wrong-key"))
            refused(client, bearer(GLOBEX_KEY))
        with tritonclient(gateway.url, pki.ca.cert) as client:
            refused(client, bearer(ACME_KEY))
    assert f"(port {gateway.gateway.port}, mutual TLS)" in caplog.text
    secrets = [ACME_KEY, GLOBEX_KEY, "s3cret"]
    for issued in (pki.server, pki.acme):
        secrets += [line for line in issued.key.read_text().splitlines() if "PRIVATE KEY" not in line]
    assert [s for s in secrets if s in caplog.text] == []


# -- the Python client and CLI -----------------------------------------------------------


def test_python_client_over_mtls_and_tls(mtls_gateway: GatewayThread, tls_gateway: GatewayThread, pki: Pki) -> None:
    mutual = TlsOptions(ca_file=str(pki.ca.cert), cert_file=str(pki.acme.cert), key_file=str(pki.acme.key))
    with Client(mtls_gateway.url, tls=mutual) as client:
        assert client.usage().tenant == "acme"
    with Client(mtls_gateway.url, GLOBEX_KEY, tls=mutual) as client:
        with pytest.raises(ClientError, match="UNAUTHENTICATED: the API key and the client certificate"):
            client.usage()
    with Client(tls_gateway.url, GLOBEX_KEY, tls=TlsOptions(ca_file=str(pki.ca.cert))) as client:
        assert client.usage().tenant == "globex"


def https_client(gateway: GatewayThread, pki: Pki, key: str, client: Issued | None = None) -> openai.OpenAI:
    """The openai SDK over HTTPS, trusting the test CA (and presenting `client`'s certificate)."""
    trust = ssl.create_default_context(cafile=str(pki.ca.cert))
    if client is not None:
        trust.load_cert_chain(str(client.cert), str(client.key))
    return openai.OpenAI(
        base_url=f"https://127.0.0.1:{gateway.gateway.http_port}/v1",
        api_key=key,
        http_client=httpx.Client(verify=trust),
        max_retries=0,
    )


def test_openai_sdk_over_tls_on_the_openai_listener(tls_gateway: GatewayThread, pki: Pki) -> None:
    require_model("minilm")
    vectors = https_client(tls_gateway, pki, ACME_KEY).embeddings.create(model="minilm", input=["a cat", "a dog"])
    assert [len(v.embedding) for v in vectors.data] == [384, 384]
    with pytest.raises(openai.AuthenticationError):
        https_client(tls_gateway, pki, "not-a-key").models.list()
    plaintext = openai.OpenAI(base_url=f"http://127.0.0.1:{tls_gateway.gateway.http_port}/v1", api_key=ACME_KEY,
                              max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        plaintext.models.list()


def test_openai_listener_over_mtls_identifies_by_certificate(mtls_gateway: GatewayThread, pki: Pki) -> None:
    require_model("minilm")
    # The SDK always sends a key; the certificate alone identifies over plain HTTPS.
    trust = ssl.create_default_context(cafile=str(pki.ca.cert))
    trust.load_cert_chain(str(pki.globex.cert), str(pki.globex.key))
    url = f"https://127.0.0.1:{mtls_gateway.gateway.http_port}/v1/models"
    assert {m["id"] for m in httpx.get(url, verify=trust).json()["data"]} == {"identity"}
    assert https_client(mtls_gateway, pki, ACME_KEY, pki.acme).embeddings.create(model="minilm", input="x").data
    stranger = ssl.create_default_context(cafile=str(pki.ca.cert))
    stranger.load_cert_chain(str(pki.stranger.cert), str(pki.stranger.key))
    assert httpx.get(url, verify=stranger).status_code == 401
    with pytest.raises(httpx.HTTPError):  # no certificate: the handshake fails
        httpx.get(url, verify=ssl.create_default_context(cafile=str(pki.ca.cert)))


def test_probes_read_plaintext_health_while_the_listeners_speak_tls(
    mtls_gateway: GatewayThread, tls_gateway: GatewayThread
) -> None:
    for gateway in (mtls_gateway, tls_gateway):
        base = f"http://127.0.0.1:{gateway.gateway.metrics_port}"
        for path, body in (("/healthz", b"ok\n"), ("/readyz", b"ready\n")):
            with urllib.request.urlopen(base + path, timeout=5) as reply:
                assert (reply.status, reply.read()) == (200, body)
        with urllib.request.urlopen(base + "/metrics", timeout=5) as reply:
            assert b"qosgate_upstream_live" in reply.read()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "QOSGATE_API_KEY"}
    return subprocess.run([str(CLI), *args], env=env, capture_output=True, text=True, timeout=120, check=False)


def test_cli_over_mtls_and_tls(mtls_gateway: GatewayThread, tls_gateway: GatewayThread, pki: Pki) -> None:
    run = cli(
        "--target", mtls_gateway.url, "--ca", str(pki.ca.cert),
        "--cert", str(pki.globex.cert), "--key", str(pki.globex.key), "usage",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("tenant globex,")
    run = cli("--target", tls_gateway.url, "--ca", str(pki.ca.cert), "--api-key", ACME_KEY, "usage")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("tenant acme,")
    run = cli("--target", tls_gateway.url, "--cert", str(pki.acme.cert), "usage")
    assert run.returncode == 2
    assert "give both a client certificate and its key" in run.stderr


NODE_USAGE = """
const [module, target, ca, cert, key] = process.argv.slice(1);
const { QosgateClient, tlsCredentials } = require(module);
const client = new QosgateClient(target, undefined, tlsCredentials({ ca, cert, key }));
client.usage().then(
  (usage) => { console.log(usage.tenant); client.close(); },
  (error) => { console.error(error.message); process.exit(1); },
);
"""


def test_node_client_over_mtls(mtls_gateway: GatewayThread, pki: Pki) -> None:
    node = shutil.which("node")
    if node is None or not (NODE_CLIENT.parent / "node_modules").is_dir():
        pytest.fail("node or the Node client's packages missing: install Node.js 20 and run `make node-deps`")
    run = subprocess.run(
        [node, "-e", NODE_USAGE, str(NODE_CLIENT), mtls_gateway.url, str(pki.ca.cert), str(pki.acme.cert), str(pki.acme.key)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "acme"


# -- perf_analyzer -----------------------------------------------------------------------


def perf_analyzer(gateway: GatewayThread, *args: str) -> subprocess.CompletedProcess[str]:
    if not PERF_ANALYZER.exists():
        pytest.fail(f"perf_analyzer missing at {PERF_ANALYZER}: run `make tools`")
    bounded = ("--measurement-mode=count_windows", "--measurement-request-count=10", "--max-trials=10")
    return subprocess.run(
        [str(PERF_ANALYZER), "-i", "grpc", "-u", gateway.url, "-m", "identity", "--concurrency-range=2",
         "--shape=INPUT0:16", "--stability-percentage=999", *bounded, "--ssl-grpc-use-ssl", *args],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("mode", [(), ("--streaming",)], ids=["unary", "streaming"])
def test_perf_analyzer_over_mtls_identified_by_its_certificate(
    mtls_gateway: GatewayThread, pki: Pki, mode: tuple[str, ...]
) -> None:
    require_model("identity")
    run = perf_analyzer(
        mtls_gateway,
        f"--ssl-grpc-root-certifications-file={pki.ca.cert}",
        f"--ssl-grpc-private-key-file={pki.acme.key}",
        f"--ssl-grpc-certificate-chain-file={pki.acme.cert}",
        *mode,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Throughput:" in run.stdout


def test_perf_analyzer_over_tls_with_a_key(tls_gateway: GatewayThread, pki: Pki) -> None:
    require_model("identity")
    run = perf_analyzer(
        tls_gateway, f"--ssl-grpc-root-certifications-file={pki.ca.cert}", "-H", f"authorization:Bearer {ACME_KEY}"
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Throughput:" in run.stdout


# -- TLS to the upstream -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_triton(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalTriton]:
    """A Triton of its own (identity only) whose gRPC endpoint requires mutual TLS."""
    require_model("identity")
    triton_cert = pki.ca.server("triton")
    server = LocalTriton(
        models=["identity"],
        ports=TritonPorts(grpc=free_port(), http=free_port(), metrics=free_port()),
        log_path=tmp_path_factory.mktemp("tls-triton") / "tritonserver.log",
        extra_args=[
            "--grpc-use-ssl=true",
            f"--grpc-server-cert={triton_cert.cert}",
            f"--grpc-server-key={triton_cert.key}",
            f"--grpc-root-cert={pki.ca.cert}",
            "--grpc-use-ssl-mutual=true",
        ],
    )
    with started_then_killed(server):
        yield server


def upstream(triton: LocalTriton, **tls: str) -> list[dict[str, Any]]:
    return [{"name": "secure", "url": triton.ports.grpc_url, "tls": tls}]


def test_gateway_reaches_a_triton_that_requires_mutual_tls(tls_triton: LocalTriton, pki: Pki) -> None:
    gateway_cert = pki.ca.client("gateway")
    config = gateway_config(
        tls_triton.ports.grpc_url,
        upstreams=upstream(tls_triton, ca=str(pki.ca.cert), cert=str(gateway_cert.cert), key=str(gateway_cert.key)),
    )
    # The local listener stays plaintext: tenants connect as before.
    with GatewayThread(config) as gateway, grpcclient.InferenceServerClient(gateway.url) as client:
        assert gateway.gateway.pool.live
        infer_identity(client, bearer(ACME_KEY))


def test_without_the_right_credentials_that_triton_stays_unreachable(tls_triton: LocalTriton, pki: Pki) -> None:
    # Proof that Triton really requires TLS with a client certificate: plaintext, or TLS
    # without the gateway's certificate, never makes it ready.
    with grpcclient.InferenceServerClient(tls_triton.ports.grpc_url) as direct:
        with pytest.raises(InferenceServerException):
            direct.is_server_ready(client_timeout=5)
    for upstreams in (
        [{"name": "plain", "url": tls_triton.ports.grpc_url}],
        upstream(tls_triton, ca=str(pki.ca.cert)),
    ):
        config = gateway_config(tls_triton.ports.grpc_url, upstreams=upstreams)
        with GatewayThread(config) as gateway, grpcclient.InferenceServerClient(gateway.url) as client:
            assert not gateway.gateway.pool.live
            error = refused(client, bearer(ACME_KEY))
            assert error.status() == "StatusCode.UNAVAILABLE"
            assert "no live Triton upstream" in error.message()

