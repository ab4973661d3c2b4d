"""Mutual TLS between Furlong services: which files a process presents and trusts, checked once
at start-up.

With TLS configured, every gRPC server of the process serves only TLS and requires a client
certificate signed by the configured CA, and every channel presents the process's certificate and
accepts only servers whose certificate that CA signed. One CA, one certificate and one key per
process (a process is both server and client).

`server_name` is the name channels expect in a server's certificate (subject alternative name)
instead of the host of the address they dial. Pod IPs change and per-pod DNS names are many, so a
deployment can give every service's certificate one shared name (say `furlong-internal`) and set
it here; the trust decision is then "signed by our private CA", which is what mutual TLS inside a
cluster is for.

This module reads files and builds grpc credentials; it knows nothing about flags or the
environment (the composition root passes paths in).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc

_CERT_MARKER = b"-----BEGIN CERTIFICATE-----"
_KEY_MARKER = b"PRIVATE KEY-----"
# gRPC option that makes a channel verify the server certificate against this name instead of
# the address host (it is also sent as TLS SNI).
TARGET_NAME_OPTION = "grpc.ssl_target_name_override"


@dataclass(frozen=True)
class TlsConfig:
    """PEM bytes of the CA that signs every service's certificate, this process's certificate
    chain and its private key. The key never appears in repr."""

    ca_cert: bytes
    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)
    server_name: str = ""

    def __post_init__(self) -> None:
        for name, marker in (("ca_cert", _CERT_MARKER), ("cert", _CERT_MARKER), ("key", _KEY_MARKER)):
            value = getattr(self, name)
            if not isinstance(value, bytes) or marker not in value:
                raise ValueError(f"TlsConfig.{name} is not PEM (no {marker.decode()!r} line)")
        if self.server_name != self.server_name.strip() or any(c.isspace() for c in self.server_name):
            raise ValueError(f"TlsConfig.server_name {self.server_name!r} must not contain whitespace")

    def server_credentials(self) -> grpc.ServerCredentials:
        """Serve TLS with this certificate and require a client certificate the CA signed."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca_cert, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Present this certificate; trust only servers the CA signed."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_cert, private_key=self.key, certificate_chain=self.cert
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [(TARGET_NAME_OPTION, self.server_name)] if self.server_name else []


@dataclass(frozen=True)
class TlsFiles:
    """Paths of the CA certificate, certificate and key as given on a command line: all three or
    none ("" = not given); `server_name` only together with them."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    def __post_init__(self) -> None:
        given = {flag: path for flag, path in self._flags() if path}
        if given and len(given) != 3:
            missing = [flag for flag, path in self._flags() if not path]
            raise ValueError(
                f"mutual TLS needs --tls-ca-file, --tls-cert-file and --tls-key-file "
                f"together; missing {', '.join(missing)}"
            )
        if self.server_name and not given:
            raise ValueError(f"--tls-server-name {self.server_name!r} given without the TLS files")

    def _flags(self) -> tuple[tuple[str, str], ...]:
        return (
            ("--tls-ca-file", self.ca_file),
            ("--tls-cert-file", self.cert_file),
            ("--tls-key-file", self.key_file),
        )

    @property
    def enabled(self) -> bool:
        return bool(self.ca_file)

    def load(self) -> TlsConfig | None:
        """The TLS configuration these files hold (None when none are given). ValueError naming
        the flag and file when one cannot be read, is not PEM, or the key does not belong to the
        certificate; never includes key material."""
        if not self.enabled:
            return None
        ca, cert, key = (_read(flag, path) for flag, path in self._flags())
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            context.load_verify_locations(cafile=self.ca_file)
        except ssl.SSLError as exc:
            raise ValueError(
                f"--tls-ca-file {self.ca_file}: not a usable CA certificate ({exc.reason or exc})"
            ) from None
        try:
            context.load_cert_chain(certfile=self.cert_file, keyfile=self.key_file)
        except ssl.SSLError as exc:
            raise ValueError(
                f"--tls-cert-file {self.cert_file} and --tls-key-file {self.key_file}: "
                f"not a certificate with its private key ({exc.reason or exc})"
            ) from None
        try:
            return TlsConfig(ca_cert=ca, cert=cert, key=key, server_name=self.server_name)
        except ValueError as exc:
            raise ValueError(f"TLS files {self.ca_file}, {self.cert_file}, {self.key_file}: {exc}") from None


def _read(flag: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {flag} {path}: {exc.strerror}") from None
