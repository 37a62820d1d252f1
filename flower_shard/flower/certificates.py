"""TLS certificates for a SuperLink and key pairs for SuperNode authentication.

Made with the ``cryptography`` package (a dependency of Flower), so no ``openssl`` command is
needed. Meant for loopback deployments, tests and first trials; a production SuperLink should
get its certificate from the site's own CA.

- :func:`make_tls_certificates`: a CA and a server certificate signed by it, valid for the
  given host names and IP addresses (``flower-superlink --ssl-ca-certfile --ssl-certfile
  --ssl-keyfile``; clients trust the CA with ``--root-certificates`` / ``root-certificates``).
- :func:`make_supernode_keys`: an EC key pair (NIST P-384) in the OpenSSH formats that
  Flower 1.42 reads: the public key for ``flwr supernode register KEY.pub CONNECTION``, the
  private key for ``flower-supernode --auth-supernode-private-key KEY``.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("127.0.0.1", "localhost")
CA_NAME = "flower-shard test CA"


@dataclass(frozen=True)
class TlsFiles:
    """Where :func:`make_tls_certificates` wrote the SuperLink's TLS files (PEM)."""

    ca_cert: Path
    """The CA certificate: ``--ssl-ca-certfile`` on the SuperLink, ``--root-certificates`` on
    every SuperNode, ``root-certificates`` in the ``flwr`` connection."""
    server_cert: Path
    """The SuperLink's certificate, signed by the CA: ``--ssl-certfile``."""
    server_key: Path
    """The SuperLink's private key (mode 0600): ``--ssl-keyfile``."""


@dataclass(frozen=True)
class SuperNodeKeys:
    """Where :func:`make_supernode_keys` wrote one SuperNode's key pair (OpenSSH formats)."""

    private_key: Path
    """The private key (mode 0600): ``--auth-supernode-private-key`` of ``flower-supernode``
    and ``flower-shard node``."""
    public_key: Path
    """The public key: ``flwr supernode register PUBLIC_KEY CONNECTION`` admits the node."""


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if private:
        # Create the file owner-only from the start: a chmod after writing would leave a
        # window in which another user could read the key.
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    else:
        path.write_bytes(data)


def _subject_alt_names(hosts: tuple[str, ...] | list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """A CA signs certificates; a TLS server signs handshakes and agrees keys (ECDHE)."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not ca,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def make_tls_certificates(
    out_dir: str | os.PathLike,
    hosts: tuple[str, ...] | list[str] = DEFAULT_HOSTS,
    valid_days: int = 30,
) -> TlsFiles:
    """Make a CA and a SuperLink server certificate signed by it.

    Parameters
    ----------
    out_dir : path
        Directory for ``ca.crt``, ``server.pem`` and ``server.key`` (created if needed;
        existing files are replaced).
    hosts : sequence of str
        Names the server certificate is valid for: IP addresses become IP SANs, anything else
        DNS SANs. Clients check the address they dial against these, so include every name
        used to reach the SuperLink (``flwr run``, SuperNodes, and the SuperLink's own
        SuperExec, which dials ``127.0.0.1``).
    valid_days : int
        Validity of both certificates, from one hour ago (tolerates small clock skew).

    Returns
    -------
    TlsFiles
        The paths written.
    """
    if not hosts:
        raise ValueError("make_tls_certificates needs at least one host name or IP address")
    out = Path(out_dir)
    start = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(hours=1)
    end = start + datetime.timedelta(days=valid_days)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_cert = _ca_certificate(ca_key, start, end)
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = _server_certificate(server_key, ca_key, ca_cert, list(hosts), start, end)

    files = TlsFiles(out / "ca.crt", out / "server.pem", out / "server.key")
    _write(files.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM))
    _write(files.server_cert, server_cert.public_bytes(serialization.Encoding.PEM))
    _write(
        files.server_key,
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        private=True,
    )
    return files


def _validity(builder: x509.CertificateBuilder, start, end) -> x509.CertificateBuilder:
    """A fresh serial number and the validity window."""
    return (
        builder.serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
    )


def _ca_certificate(key: ec.EllipticCurvePrivateKey, start, end) -> x509.Certificate:
    """A self-signed CA that may sign server certificates only (path length 0)."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
    builder = x509.CertificateBuilder().subject_name(name).issuer_name(name)
    return (
        _validity(builder.public_key(key.public_key()), start, end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA384())
    )


def _server_certificate(
    key: ec.EllipticCurvePrivateKey,
    ca_key: ec.EllipticCurvePrivateKey,
    ca: x509.Certificate,
    hosts: list[str],
    start,
    end,
) -> x509.Certificate:
    """A TLS server certificate for ``hosts`` (the first is its common name), signed by ``ca``."""
    ca_ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
    )
    return (
        _validity(builder, start, end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(_subject_alt_names(hosts), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca_key, hashes.SHA384())
    )


def make_supernode_keys(out_dir: str | os.PathLike, name: str = "supernode") -> SuperNodeKeys:
    """Make one SuperNode's authentication key pair (EC, NIST P-384).

    Flower 1.42 reads both keys with ``cryptography``'s OpenSSH loaders
    (``load_ssh_private_key``, ``load_ssh_public_key``), so they are written in those formats,
    unencrypted (``flower-supernode`` takes no passphrase).

    Parameters
    ----------
    out_dir : path
        Directory for ``NAME.key`` and ``NAME.pub`` (created if needed; replaced if present).
    name : str
        File stem, e.g. the node's or the site's name.

    Returns
    -------
    SuperNodeKeys
        The paths written.
    """
    key = ec.generate_private_key(ec.SECP384R1())
    out = Path(out_dir)
    files = SuperNodeKeys(out / f"{name}.key", out / f"{name}.pub")
    _write(
        files.private_key,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        ),
        private=True,
    )
    _write(
        files.public_key,
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        + b"\n",
    )
    return files


def load_supernode_private_key(path: str | os.PathLike) -> ec.EllipticCurvePrivateKey:
    """Read a SuperNode private key the way ``flower-supernode`` does, or raise ValueError.

    Parameters
    ----------
    path : path
        An unencrypted OpenSSH private key file (as :func:`make_supernode_keys` or
        ``ssh-keygen -t ecdsa -b 384`` write it).

    Returns
    -------
    EllipticCurvePrivateKey
        The key, on a NIST curve.
    """
    try:
        key = serialization.load_ssh_private_key(Path(path).read_bytes(), None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not an unencrypted OpenSSH private key ({exc})") from exc
    except Exception as exc:  # UnsupportedAlgorithm and friends: one message for all
        raise ValueError(f"unreadable private key ({exc})") from exc
    return _nist(key, ec.EllipticCurvePrivateKey)


def load_supernode_public_key(path: str | os.PathLike) -> ec.EllipticCurvePublicKey:
    """Read a SuperNode public key the way ``flwr supernode register`` does, or raise ValueError.

    Parameters
    ----------
    path : path
        An OpenSSH public key file (``ecdsa-sha2-nistp384 AAAA...``).

    Returns
    -------
    EllipticCurvePublicKey
        The key, on a NIST curve.
    """
    try:
        key = serialization.load_ssh_public_key(Path(path).read_bytes())
    except Exception as exc:  # ValueError, UnsupportedAlgorithm: one message for all
        raise ValueError(f"not an OpenSSH public key ({exc})") from exc
    return _nist(key, ec.EllipticCurvePublicKey)


NIST_CURVES = ("secp256r1", "secp384r1", "secp521r1")  # what Flower 1.42 accepts


def _nist(key, kind):
    """``key`` if it is an EC key of ``kind`` on a NIST curve; ValueError otherwise."""
    if not isinstance(key, kind):
        raise ValueError(f"an EC key is required, got {type(key).__name__}")
    if key.curve.name not in NIST_CURVES:
        raise ValueError(f"EC curve {key.curve.name} is not a NIST curve")
    return key
