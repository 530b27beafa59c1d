"""Keys, certificates and bundles for the fleet tests, made with cryptography in a tmp dir."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from edged.fleet.bundle import make_bundle
from edged.tools.demo import make_tiny_mlp


@dataclass(frozen=True)
class KeyPair:
    private: Path
    public: Path


def make_key(folder: Path, name: str) -> KeyPair:
    key = ec.generate_private_key(ec.SECP256R1())
    private = folder / f"{name}.pem"
    public = folder / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return KeyPair(private, public)


@dataclass(frozen=True)
class CertChain:
    root: Path  # the CA certificate a device trusts
    leaf: Path  # the signing certificate
    key: Path  # the signing certificate's private key


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return key


def make_chain(folder: Path, name: str, *, signing: bool = True) -> CertChain:
    """A self-signed CA and a signing certificate it issued (key usage: digital signature,
    unless ``signing`` is false)."""
    ca_pair, leaf_pair = make_key(folder, f"{name}-ca"), make_key(folder, f"{name}-leaf")
    ca_key, leaf_key = _load_key(ca_pair.private), _load_key(leaf_pair.private)
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} root")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    leaf_name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "edged"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"{name} signer"),
        ]
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(leaf_name)
        .issuer_name(ca_name)
        .public_key(leaf_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    if signing:
        builder = builder.add_extension(_usage(cert_sign=False), critical=True)
    leaf = builder.sign(ca_key, hashes.SHA256())
    root_path, leaf_path = folder / f"{name}-ca.crt", folder / f"{name}-leaf.crt"
    root_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    leaf_path.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    return CertChain(root_path, leaf_path, leaf_pair.private)


def _usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def tiny_bundle(folder: Path, name: str = "tiny", version: str = "1.0.0") -> Path:
    """An unsigned bundle of the tiny MLP with two calibration samples."""
    src = folder / f"src-{name}-{version}"
    (src / "calibration").mkdir(parents=True)
    make_tiny_mlp(src / "tiny.onnx")
    for i in range(2):
        (src / "calibration" / f"{i}.npy").write_bytes(b"\x93NUMPY" + bytes([i]) * 64)
    return make_bundle(
        folder / f"{name}-{version}",
        name=name,
        version=version,
        model={"path": "model.onnx", "calibration": {"data": "calibration"}},
        files={"model.onnx": src / "tiny.onnx", "calibration": src / "calibration"},
    )
