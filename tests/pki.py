"""Throwaway certificate authorities and certificates for mutual-TLS tests, made with the openssl
command line (EC P-256 keys, valid for one day)."""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path


def openssl() -> str:
    found = shutil.which("openssl")
    if found is None:
        pytest.skip("the openssl command line is needed to make test certificates")
    return found


def _run(*args: str | Path) -> None:
    result = subprocess.run([openssl(), *map(str, args)], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise AssertionError(f"openssl {' '.join(map(str, args))} failed:\n{result.stderr}")


def make_ca(directory: Path, name: str) -> CertFiles:
    """A self-signed CA certificate and key under directory."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = CertFiles(directory / f"{name}.crt", directory / f"{name}.key")
    _run(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        ca.key,
        "-out",
        ca.cert,
        "-days",
        "1",
        "-subj",
        f"/CN={name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    return ca


def make_cert(
    ca: CertFiles,
    directory: Path,
    name: str,
    dns: tuple[str, ...] = ("localhost",),
    ips: tuple[str, ...] = ("127.0.0.1",),
) -> CertFiles:
    """A certificate for name signed by ca, usable as TLS server and client, with the given DNS
    names and IP addresses as subject alternative names."""
    out = CertFiles(directory / f"{name}.crt", directory / f"{name}.key")
    csr = directory / f"{name}.csr"
    ext = directory / f"{name}.ext"
    sans = [f"DNS:{d}" for d in dns] + [f"IP:{i}" for i in ips]
    ext.write_text(
        f"subjectAltName={','.join(sans)}\n"
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
    )
    _run(
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        out.key,
        "-out",
        csr,
        "-subj",
        f"/CN={name}",
    )
    _run(
        "x509",
        "-req",
        "-in",
        csr,
        "-CA",
        ca.cert,
        "-CAkey",
        ca.key,
        "-set_serial",
        str(secrets.randbits(63)),
        "-days",
        "1",
        "-extfile",
        ext,
        "-out",
        out.cert,
    )
    return out
