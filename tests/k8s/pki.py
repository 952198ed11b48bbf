"""Throwaway keys, certificates, tokens and kubeconfigs for the Kubernetes test tier.

One certificate authority per tier signs every serving certificate (each API server's, each
kube-scheduler's and kube-controller-manager's), so one CA file verifies all of them; it is
also the ``ca.crt`` the controller-manager gives service accounts. Keys are ECDSA P-256: they
are generated in milliseconds, which keeps the tier's start in seconds. Nothing here is ever
used outside one test run: the keys live in the tier's temporary directory and die with it.

Clients authenticate with static bearer tokens (``--token-auth-file``), one per identity, so
no client certificate is needed: kubelets too are token identities (``system:node:<name>``
in ``system:nodes``), which is all the Node authorizer and NodeRestriction look at.
"""

from __future__ import annotations

import csv
import datetime
import ipaddress
import secrets
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=2)  # longer than any test run, short enough to never matter


@dataclass(frozen=True)
class Identity:
    """Who a token authenticates as: a Kubernetes user name and its groups."""

    key: str  # how the tier names it: "admin", "controller", "kubelet:a-gpu-1" …
    user: str
    groups: tuple[str, ...] = ()
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)


def kubelet_identity(node: str) -> Identity:
    """The identity the Node authorizer and NodeRestriction recognise as node ``node``."""
    return Identity(f"kubelet:{node}", f"system:node:{node}", ("system:nodes",))


def write_token_file(path: Path, identities: Iterable[Identity]) -> None:
    """``--token-auth-file``: token,user,uid,"group1,group2" per line."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        for ident in identities:
            writer.writerow([ident.token, ident.user, ident.user, ",".join(ident.groups)])
    path.chmod(0o600)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write_private(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o600)
    return path


@dataclass
class CertificateAuthority:
    """The tier's CA: ``issue`` signs serving certificates for loopback names."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    cert_path: Path

    @classmethod
    def create(cls, directory: Path) -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpufleet-test-ca")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        cert_path = directory / "ca.crt"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cls(key, cert, cert_path)

    def issue(self, directory: Path, name: str, dns_names: Iterable[str] = ()) -> tuple[Path, Path]:
        """A serving certificate for 127.0.0.1 and localhost (plus ``dns_names``): the paths of
        its certificate and key, ``<name>.crt`` and ``<name>.key`` in ``directory``."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        sans: list[x509.GeneralName] = [
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.DNSName("localhost"),
        ]
        sans += [x509.DNSName(n) for n in dns_names]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), False
            )
            .sign(self.key, hashes.SHA256())
        )
        cert_path = directory / f"{name}.crt"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path = _write_private(directory / f"{name}.key", _pem_key(key))
        return cert_path, key_path


def trust(ca_path: Path) -> ssl.SSLContext:
    """A client TLS context that trusts the tier's CA (and nothing else)."""
    return ssl.create_default_context(cafile=str(ca_path))


def write_signing_key(directory: Path, name: str) -> tuple[Path, Path]:
    """A service-account signing key pair (ES256): the private and the public key's paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    private = _write_private(directory / f"{name}.key", _pem_key(key))
    public = directory / f"{name}.pub"
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


@dataclass(frozen=True)
class KubeContext:
    """One context of a kubeconfig: a cluster's name and address, and whose token to use."""

    name: str
    server: str
    identity: Identity
    namespace: str | None = None


def write_kubeconfig(
    path: Path, ca_path: Path, contexts: Iterable[KubeContext], current: str | None = None
) -> Path:
    """A kubeconfig file with one context per entry, named as the entry (the cluster), each
    with its own cluster and user entries, trusting the tier's CA file by path."""
    entries = list(contexts)
    clusters: list[Mapping[str, object]] = []
    users: list[Mapping[str, object]] = []
    ctxs: list[Mapping[str, object]] = []
    for c in entries:
        user = f"{c.identity.key}@{c.name}"
        clusters.append(
            {"name": c.name, "cluster": {"server": c.server, "certificate-authority": str(ca_path)}}
        )
        users.append({"name": user, "user": {"token": c.identity.token}})
        context: dict[str, str] = {"cluster": c.name, "user": user}
        if c.namespace:
            context["namespace"] = c.namespace
        ctxs.append({"name": c.name, "context": context})
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "preferences": {},
        "clusters": clusters,
        "users": users,
        "contexts": ctxs,
        "current-context": current or (entries[0].name if entries else ""),
    }
    _write_private(path, yaml.safe_dump(document, sort_keys=False).encode())
    return path
