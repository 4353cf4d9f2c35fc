"""`--ssl_config_file`: TLS for every port, from TF Serving's `SSLConfig` text proto.

    server_key: "-----BEGIN PRIVATE KEY-----\n..."      # PEM text, not a path (as TF Serving)
    server_cert: "-----BEGIN CERTIFICATE-----\n..."
    custom_ca: "-----BEGIN CERTIFICATE-----\n..."       # CA that signs client certificates
    client_verify: true                                  # require a client certificate

The gRPC port gets `grpc.ssl_server_credentials`, and both HTTP ports (TF Serving REST and
the OpenAI API) get the same key and certificate through uvicorn (tensorflow_model_server
itself serves REST in plaintext only; tokenserve does not leave one port open when TLS was
asked for). With `client_verify`, a client must present a certificate signed by `custom_ca`
on every port, or the handshake fails.

The file is read and every PEM is checked when the config is built, so a bad key or a
certificate that does not match it fails before any port opens.
"""

from __future__ import annotations

import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, text_format
from google.protobuf.message_factory import GetMessageClass

from tokenserve.errors import ConfigError


def _ssl_config_class():
    """tensorflow.serving.SSLConfig (config/ssl_config.proto), which tensorflow-serving-api's
    wheel does not ship: declared with TF Serving's field names and numbers."""
    field = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="tokenserve/ssl_config.proto",
                                               package="tensorflow.serving", syntax="proto3")
    message = proto.message_type.add(name="SSLConfig")
    for number, (name, kind) in enumerate([("server_key", field.TYPE_STRING),
                                           ("server_cert", field.TYPE_STRING),
                                           ("custom_ca", field.TYPE_STRING),
                                           ("client_verify", field.TYPE_BOOL)], start=1):
        message.field.add(name=name, number=number, type=kind, label=field.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return GetMessageClass(pool.FindMessageTypeByName("tensorflow.serving.SSLConfig"))


SSLConfigProto = _ssl_config_class()


@dataclass(frozen=True)
class SSLConfig:
    """TLS settings of a server; PEM text, checked on construction.

    Example:
        tls = SSLConfig.read("/etc/tokenserve/ssl.config")
        server.add_secure_port("0.0.0.0:8500", tls.grpc_credentials())
    """

    server_key: str
    server_cert: str
    custom_ca: str = ""
    client_verify: bool = False

    def __post_init__(self) -> None:
        if not self.server_key.strip() or not self.server_cert.strip():
            raise ConfigError("--ssl_config_file needs both server_key and server_cert")
        if self.client_verify and not self.custom_ca.strip():
            raise ConfigError("--ssl_config_file: client_verify needs custom_ca (the CA that "
                              "signs client certificates)")
        with self.files() as paths:  # the same loading uvicorn does: fail now, not later
            try:
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                context.load_cert_chain(paths["ssl_certfile"], paths["ssl_keyfile"])
                if "ssl_ca_certs" in paths:
                    context.load_verify_locations(paths["ssl_ca_certs"])
            except (ssl.SSLError, OSError) as error:
                raise ConfigError(f"--ssl_config_file: the key, certificate or CA is not "
                                  f"usable PEM: {error}") from None

    @classmethod
    def parse(cls, text: str) -> "SSLConfig":
        """From SSLConfig text format.

        Raises:
            ConfigError: not an SSLConfig, or unusable PEM.
        """
        message = SSLConfigProto()
        try:
            text_format.Parse(text, message)
        except text_format.ParseError as error:
            raise ConfigError(f"--ssl_config_file is not an SSLConfig text proto: {error}"
                              ) from None
        return cls(message.server_key, message.server_cert, message.custom_ca,
                   message.client_verify)

    @classmethod
    def read(cls, path: str | Path) -> "SSLConfig":
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ConfigError(f"cannot read --ssl_config_file: {error}") from None
        return cls.parse(text)

    def grpc_credentials(self):
        """Server credentials for `grpc_server.add_secure_port`."""
        import grpc

        return grpc.ssl_server_credentials(
            [(self.server_key.encode(), self.server_cert.encode())],
            root_certificates=self.custom_ca.encode() if self.custom_ca else None,
            require_client_auth=self.client_verify)

    def files(self) -> "_PemFiles":
        """A context manager giving uvicorn's ssl options (`ssl_keyfile`, `ssl_certfile`,
        `ssl_ca_certs`, `ssl_cert_reqs`) as files in a private temporary directory, removed
        on exit (uvicorn reads them once, when the server starts)."""
        return _PemFiles(self)


class _PemFiles:
    def __init__(self, config: SSLConfig):
        self.config = config
        self.directory: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> dict:
        self.directory = tempfile.TemporaryDirectory(prefix="tokenserve-tls-")
        root = Path(self.directory.name)  # mode 0700: the key is readable by us only

        def write(name: str, text: str) -> str:
            path = root / name
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as file:
                file.write(text)
            return str(path)

        options = {"ssl_keyfile": write("server.key", self.config.server_key),
                   "ssl_certfile": write("server.crt", self.config.server_cert)}
        if self.config.custom_ca:
            options["ssl_ca_certs"] = write("ca.crt", self.config.custom_ca)
        if self.config.client_verify:
            options["ssl_cert_reqs"] = ssl.CERT_REQUIRED
        return options

    def __exit__(self, *exc) -> None:
        if self.directory is not None:
            self.directory.cleanup()
