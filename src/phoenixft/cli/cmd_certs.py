"""`phoenixft certs DIR [--hosts NAME,...]`: a job CA and the certificates its hosts present.

Writes into DIR (created mode 0700; refused if it already holds a CA): `ca.crt` and `ca.key` (the job
CA, ECDSA P-256, self-signed), and per name in `--hosts` (default: one, `job`) `NAME.crt` and
`NAME.key`, signed by the CA, usable both as a TLS server and client (the control plane's gateway,
forwarders and etcd members present them), with 127.0.0.1, ::1, localhost and `--san` as alternative
names (etcd's own gateway checks the member's name), and the name as their subject's organizational
unit, not as a Common Name (etcd's JSON gateway refuses a client certificate with one once etcd's
users are on: `--control-plane etcd` turns them on). Keys are mode 0600. Every process of the job
then takes `--tls-cert DIR/NAME.crt --tls-key DIR/NAME.key --tls-ca DIR/ca.crt`. Keep `ca.key` off
the hosts: it signs new members.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
from pathlib import Path
from typing import Any

from phoenixft.errors import UserError

__all__ = ["add_parser", "make_certs"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("certs", help="make a job CA and the TLS certificates of its hosts (for --tls-cert/--tls-key/"
                       "--tls-ca)", description=__doc__.split("\n\n", 1)[1] if __doc__ else None)
    p.add_argument("dir", metavar="DIR", help="directory to write into (created mode 0700)")
    p.add_argument("--hosts", default="job", metavar="NAME,...",
                   help="one certificate and key per name (default: one, 'job', for every host)")
    p.add_argument("--san", default="", metavar="ADDR,...",
                   help="more alternative names (IP addresses or DNS names) for every certificate")
    p.add_argument("--days", type=int, default=30, help="validity in days (default: 30)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.hosts.split(",") if n.strip()]
    bad = [n for n in names if not _NAME.match(n) or n == "ca"]
    if not names or bad:
        raise UserError(f"--hosts={args.hosts}: need names of letters, digits, '.', '-', '_' (not 'ca')")
    if not 1 <= args.days <= 3650:
        raise UserError(f"--days={args.days} is invalid: need 1 to 3650")
    sans = [s.strip() for s in args.san.split(",") if s.strip()]
    written = make_certs(Path(args.dir), names, sans, args.days)
    print(f"phoenixft certs: wrote {', '.join(str(p) for p in written)}")
    d = Path(args.dir)
    print(f"give each host: --tls-cert {d / (names[0] + '.crt')} --tls-key {d / (names[0] + '.key')} "
          f"--tls-ca {d / 'ca.crt'}  (keep {d / 'ca.key'} off the hosts)")
    return 0


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _san(names: list[str]) -> Any:
    from cryptography import x509

    out: list[Any] = []
    for n in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(out)


def make_certs(d: Path, names: list[str], sans: list[str], days: int = 30) -> list[Path]:
    """Write a job CA and one signed certificate and key per name into `d`; the files written."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise UserError("phoenixft certs needs the `cryptography` package (pip install cryptography), or make the "
                        "CA and certificates with openssl") from None
    if (d / "ca.key").exists() or (d / "ca.crt").exists():
        raise UserError(f"{d} already holds a CA (ca.crt/ca.key): give a new directory")
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def pem_key(k: Any) -> bytes:
        return bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"phoenixft job CA {os.urandom(4).hex()}")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    _write(d / "ca.key", pem_key(ca_key), 0o600)
    _write(d / "ca.crt", ca.public_bytes(serialization.Encoding.PEM), 0o644)
    written = [d / "ca.crt", d / "ca.key"]
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "phoenixft"),  # (no Common Name: see
                             x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, name)])  # the module docstring)
        cert = (x509.CertificateBuilder().subject_name(subject)
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(_san(["127.0.0.1", "::1", "localhost", name, *sans]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write(d / f"{name}.key", pem_key(key), 0o600)
        _write(d / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM), 0o644)
        written += [d / f"{name}.crt", d / f"{name}.key"]
    return written
