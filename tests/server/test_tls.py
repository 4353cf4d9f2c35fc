"""`tokenserve serve --ssl_config_file`: TF Serving's SSLConfig puts TLS on the gRPC port and
on both HTTP ports. Certificates are made here (a CA, a server certificate for 127.0.0.1, a
client certificate); the clients are the real ones: `grpc.ssl_channel_credentials`, httpx
and the official `openai` client with a CA bundle, and, with `client_verify`, the same
clients with and without a client certificate.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from support.openai_harness import tiny_model_dir
from support.servables import free_port
from tokenserve.errors import ConfigError
from tokenserve.server.tls import SSLConfig

KEY = "sk-tls-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _pem_key(key) -> str:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM,
                             serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def _certificate(subject: str, key, issuer_name=None, issuer_key=None, ca=False,
                 server=False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name)
               .issuer_name(issuer_name or name).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    elif not ca:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    from cryptography.hazmat.primitives import serialization

    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return cert, cert.public_bytes(serialization.Encoding.PEM).decode()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """PEM text and files: ca, server (127.0.0.1) and client, all signed by the CA."""
    from cryptography.hazmat.primitives.asymmetric import ec

    directory = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert, ca_pem = _certificate("tokenserve test CA", ca_key, ca=True)
    out = {"ca": ca_pem}
    for role in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        _, pem = _certificate(f"tokenserve test {role}", key, ca_cert.subject, ca_key,
                              server=role == "server")
        out[f"{role}_key"], out[f"{role}_cert"] = _pem_key(key), pem
    for name, text in out.items():
        (directory / f"{name}.pem").write_text(text)
    out["dir"] = directory
    return out


def ssl_config_text(pki, client_verify: bool) -> str:
    def quoted(text: str) -> str:
        return '"' + text.replace("\n", "\\n") + '"'
    return (f"server_key: {quoted(pki['server_key'])}\n"
            f"server_cert: {quoted(pki['server_cert'])}\n"
            f"custom_ca: {quoted(pki['ca'])}\n"
            f"client_verify: {'true' if client_verify else 'false'}\n")


@pytest.fixture(scope="module", params=[False, True], ids=["server-tls", "client-verify"])
def server(request, pki, tmp_path_factory):
    client_verify = request.param
    base = tiny_model_dir(tmp_path_factory).parent
    config_file = pki["dir"] / f"ssl-{client_verify}.config"
    config_file.write_text(ssl_config_text(pki, client_verify))
    ports = {name: free_port() for name in ("grpc", "rest", "openai")}
    log_path = pki["dir"] / f"server-{client_verify}.log"
    log = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenserve", "serve", f"--port={ports['grpc']}",
         f"--rest_api_port={ports['rest']}", f"--openai_port={ports['openai']}",
         "--model_name=tiny", f"--model_base_path={base}", "--file_system_poll_wait_seconds=0",
         f"--ssl_config_file={config_file}", f"--api_key={KEY}", "--precision=float32",
         "--max_num_seqs=4", "--host=127.0.0.1"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    info = {"verify": client_verify, "ports": ports, "process": process,
            "openai": f"https://127.0.0.1:{ports['openai']}",
            "rest": f"https://127.0.0.1:{ports['rest']}", "grpc": f"127.0.0.1:{ports['grpc']}"}
    deadline = time.monotonic() + 180
    while "Serving the OpenAI API" not in log_path.read_text():
        assert process.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.3)
    yield info
    process.terminate()
    process.wait(timeout=30)


def client_context(pki, with_certificate: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki["dir"] / "ca.pem"))
    if with_certificate:
        context.load_cert_chain(pki["dir"] / "client_cert.pem", pki["dir"] / "client_key.pem")
    return context


def grpc_credentials(pki, with_certificate: bool) -> grpc.ChannelCredentials:
    if with_certificate:
        return grpc.ssl_channel_credentials(pki["ca"].encode(), pki["client_key"].encode(),
                                            pki["client_cert"].encode())
    return grpc.ssl_channel_credentials(pki["ca"].encode())


def model_status(channel) -> int:
    from tensorflow_serving.apis import get_model_status_pb2, model_service_pb2_grpc

    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = "tiny"
    reply = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(
        request, metadata=[("authorization", f"Bearer {KEY}")], timeout=30)
    return reply.model_version_status[0].state


def test_every_port_serves_tls_to_a_client_that_trusts_the_ca(server, pki):
    import openai

    from tensorflow_serving.apis import get_model_status_pb2
    from tokenserve.server.proto.tokenserve import generation_pb2, generation_pb2_grpc

    verify = client_context(pki, with_certificate=server["verify"])
    with httpx.Client(verify=verify, headers=AUTH, timeout=60) as http:
        client = openai.OpenAI(base_url=server["openai"] + "/v1", api_key=KEY,
                               http_client=http, max_retries=0)
        completion = client.completions.create(model="tiny", prompt="def add(a, b):",
                                               max_tokens=4, extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 4
        rest = http.get(server["rest"] + "/v1/models/tiny")
        assert rest.status_code == 200
        assert rest.json()["model_version_status"][0]["state"] == "AVAILABLE"
    with grpc.secure_channel(server["grpc"], grpc_credentials(pki, server["verify"])) as channel:
        assert model_status(channel) == \
            get_model_status_pb2.ModelVersionStatus.State.Value("AVAILABLE")
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(
            model="tiny", text="import os",
            sampling=generation_pb2.SamplingOptions(max_tokens=3, ignore_eos=True))
        responses = list(stub.Generate(request, timeout=60,
                                       metadata=[("authorization", f"Bearer {KEY}")]))
        assert responses[-1].finished and responses[-1].usage.completion_tokens == 3


def test_no_port_answers_in_plaintext(server):
    for url in (server["openai"], server["rest"]):
        plain = url.replace("https://", "http://")
        try:
            response = httpx.get(plain + "/v1/models", headers=AUTH, timeout=10)
        except httpx.HTTPError:
            continue  # the TLS server dropped the plaintext request
        assert response.status_code == 400  # uvicorn's answer to HTTP on a TLS port
    with grpc.insecure_channel(server["grpc"]) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            model_status(channel)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_that_does_not_trust_the_ca_is_refused(server):
    with pytest.raises(httpx.ConnectError):
        httpx.get(server["openai"] + "/health", timeout=10)  # the system CAs only
    with grpc.secure_channel(server["grpc"], grpc.ssl_channel_credentials()) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            model_status(channel)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_verify_refuses_a_client_without_a_certificate(server, pki):
    if not server["verify"]:
        # without client_verify, a client with only the CA bundle gets in
        with httpx.Client(verify=client_context(pki, False), timeout=30) as http:
            assert http.get(server["openai"] + "/health").status_code == 200
        return
    for url in (server["openai"] + "/health", server["rest"] + "/v1/models/tiny"):
        with httpx.Client(verify=client_context(pki, False), timeout=30) as http:
            with pytest.raises((httpx.ReadError, httpx.ConnectError,
                                httpx.RemoteProtocolError)):
                http.get(url, headers=AUTH)
    with grpc.secure_channel(server["grpc"], grpc_credentials(pki, False)) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            model_status(channel)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_bad_ssl_configs_fail_before_any_port_opens(pki, tmp_path):
    good = SSLConfig.parse(ssl_config_text(pki, client_verify=True))
    assert good.client_verify and good.custom_ca == pki["ca"]
    with pytest.raises(ConfigError, match="client_verify needs custom_ca"):
        SSLConfig(pki["server_key"], pki["server_cert"], client_verify=True)
    with pytest.raises(ConfigError, match="not usable PEM"):
        SSLConfig(pki["client_key"], pki["server_cert"])  # key and certificate differ
    with pytest.raises(ConfigError, match="not an SSLConfig"):
        SSLConfig.parse("server_key: 'x'\nport: 3\n")
    with pytest.raises(ConfigError, match="cannot read"):
        SSLConfig.read(tmp_path / "missing.config")
