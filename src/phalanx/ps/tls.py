"""Optional TLS for the parameter-server wire, and throwaway certificates for local clusters.

Set in every task (PEM files):

=====================  ==================================================================
``PHALANX_TLS_CERT``   this task's certificate (chain); its names must include the host
                       part of the task's address in the cluster spec (IP or DNS SAN)
``PHALANX_TLS_KEY``    its private key
``PHALANX_TLS_CA``     the CA that signed every task's certificate. With it, TLS is
                       *mutual*: servers accept only clients with a certificate from this
                       CA. Without it, clients check servers against the system's roots
                       and servers accept any client (the cluster secret still decides).
=====================  ==================================================================

TLS hides weights, gradients and shipped functions from a listener and stops an on-path
attacker from dropping, delaying or reordering frames unseen; the HMAC signatures of
:mod:`phalanx.ps.wire` stay on under TLS (they are what authorises a request).
``phalanx run --ps N --workers M --tls`` makes a CA and one certificate for 127.0.0.1 and
``localhost`` with :func:`generate_local` (the ``cryptography`` package), for that run only.

Example:
    >>> import tempfile
    >>> env = generate_local(tempfile.mkdtemp())
    >>> sorted(env)
    ['PHALANX_TLS_CA', 'PHALANX_TLS_CERT', 'PHALANX_TLS_KEY']
    >>> TlsConfig.from_env(env).mutual
    True
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from phalanx.errors import PhalanxError

CERT_ENV, KEY_ENV, CA_ENV = "PHALANX_TLS_CERT", "PHALANX_TLS_KEY", "PHALANX_TLS_CA"


class TlsConfigError(PhalanxError, ValueError):
    """The TLS settings are incomplete or a file cannot be read."""

    def __init__(self, name: str, value: Any, problem: str) -> None:
        self.name, self.value = name, value
        super().__init__(
            f"{name}={value!r}: {problem}.",
            hint=f"set {CERT_ENV} and {KEY_ENV} (PEM files) in every task, and {CA_ENV} for mutual TLS; "
            "`phalanx run --ps N --workers M --tls` makes them for a local cluster",
        )


def _read(name: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TlsConfigError(name, path, f"cannot be read ({e.strerror})") from None
    if b"-----BEGIN" not in data:
        raise TlsConfigError(name, path, "is not a PEM file")
    return data


@dataclass(frozen=True)
class TlsConfig:
    """A task's certificate, key and (for mutual TLS) the cluster's CA, as PEM bytes."""

    cert: bytes
    key: bytes
    ca: bytes | None = None

    @property
    def mutual(self) -> bool:
        return self.ca is not None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TlsConfig | None:
        """The settings in the environment; None when no ``PHALANX_TLS_*`` variable is set.

        Raises:
            TlsConfigError: only some are set, or a file cannot be read.
        """
        env = os.environ if environ is None else environ
        cert, key, ca = (env.get(n, "").strip() for n in (CERT_ENV, KEY_ENV, CA_ENV))
        if not (cert or key or ca):
            return None
        if not cert or not key:
            missing = CERT_ENV if not cert else KEY_ENV
            raise TlsConfigError(missing, "", "is unset while other PHALANX_TLS_* variables are set")
        return cls(_read(CERT_ENV, cert), _read(KEY_ENV, key), _read(CA_ENV, ca) if ca else None)

    def server_credentials(self, grpc: Any) -> Any:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=self.mutual
        )

    def channel_credentials(self, grpc: Any) -> Any:
        if self.mutual:
            return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)
        return grpc.ssl_channel_credentials()


def generate_local(directory: str, hosts: Sequence[str] = ("127.0.0.1", "localhost"), days: int = 7) -> dict[str, str]:
    """Writes a throwaway CA and one certificate for ``hosts`` (server and client use) to ``directory``.

    Returns the ``PHALANX_TLS_*`` variables that point to them. The keys are written readable by
    this user only; the CA's key is not kept (nothing else is ever signed with it).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "phalanx local cluster CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "phalanx task")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    os.makedirs(directory, mode=0o700, exist_ok=True)
    paths = {
        CA_ENV: os.path.join(directory, "ca.pem"),
        CERT_ENV: os.path.join(directory, "cert.pem"),
        KEY_ENV: os.path.join(directory, "key.pem"),
    }
    pem = serialization.Encoding.PEM
    contents = {
        CA_ENV: ca.public_bytes(pem),
        CERT_ENV: cert.public_bytes(pem),
        KEY_ENV: key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    }
    for name, path in paths.items():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(contents[name])
    return paths
