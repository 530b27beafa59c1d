"""``[fleet] trust``: the EC public keys and CA certificates a bundle may be signed with.

A key is known by its fingerprint, the sha256 of its PEM SubjectPublicKeyInfo in hex: the hint
model-signing writes into a key-signed signature, so the one trusted key a signature names is
found without trying each. Certificates are the roots (and intermediates) a signing
certificate's chain must reach.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from edged.fleet.bundle_base import BundleRefused, read_bounded

# The curves model-signing signs with (Sigstore's protobuf specs).
CURVES = ("secp256r1", "secp384r1", "secp521r1")
MAX_TRUST_FILE_BYTES = 1024 * 1024


@dataclass(frozen=True)
class TrustedKey:
    path: Path
    fingerprint: str  # hex sha256 of the PEM SubjectPublicKeyInfo


@dataclass(frozen=True)
class Trust:
    keys: tuple[TrustedKey, ...] = ()
    certificates: tuple[Path, ...] = ()  # PEM files of CA certificates

    @property
    def empty(self) -> bool:
        return not self.keys and not self.certificates

    def key(self, fingerprint: str) -> TrustedKey | None:
        return next((k for k in self.keys if k.fingerprint == fingerprint), None)

    def describe(self) -> str:
        parts = [f"key sha256:{k.fingerprint[:16]}... ({k.path.name})" for k in self.keys]
        parts += [f"certificates of {p.name}" for p in self.certificates]
        return ", ".join(parts) or "nothing"


def key_fingerprint(key: ec.EllipticCurvePublicKey) -> str:
    pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


def load_trust(paths: Sequence[Path]) -> Trust:
    """Every file of ``paths``, each a PEM public key or one or more PEM certificates."""
    keys: list[TrustedKey] = []
    certs: list[Path] = []
    for path in paths:
        data = read_bounded(path, MAX_TRUST_FILE_BYTES, f"fleet.trust: {path}", "trust_invalid")
        if b"-----BEGIN CERTIFICATE-----" in data:
            try:
                x509.load_pem_x509_certificates(data)
            except ValueError as e:
                raise BundleRefused(f"fleet.trust: {path}: not a PEM certificate: {e}", "trust_invalid") from None
            certs.append(path)
            continue
        try:
            key = serialization.load_pem_public_key(data)
        except (ValueError, TypeError) as e:
            raise BundleRefused(
                f"fleet.trust: {path}: neither a PEM public key nor a PEM certificate: {e}", "trust_invalid"
            ) from None
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in CURVES:
            raise BundleRefused(f"fleet.trust: {path}: not an EC public key on P-256, P-384 or P-521", "trust_invalid")
        keys.append(TrustedKey(path, key_fingerprint(key)))
    return Trust(tuple(keys), tuple(certs))


def check_private_key(path: Path) -> None:
    """ValueError naming ``path`` unless it is an unencrypted PEM EC private key on a curve
    model-signing signs with (which would otherwise fail on an RSA key with an AttributeError)."""
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), None)
    except TypeError:
        raise ValueError(f"{path}: an encrypted private key; give an unencrypted PEM key") from None
    except ValueError as e:
        raise ValueError(f"{path}: not a PEM private key: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name not in CURVES:
        raise ValueError(f"{path}: not an EC private key on P-256, P-384 or P-521")


def certificate_subject(der: bytes) -> str:
    return x509.load_der_x509_certificate(der).subject.rfc4514_string()
