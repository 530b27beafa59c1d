"""Signing a bundle and checking its signature, with the OpenSSF ``model-signing`` library.

model-signing hashes every file of the folder (sha256, no links), signs the manifest of digests
as an in-toto statement in a DSSE envelope, and writes a Sigstore bundle; its verifier checks the
signature against a key or a certificate chain, offline, then the folder against the manifest.
What edged adds: which trusted key or certificate a signature needs (read from the signature's
verification material, so the refusal can name it), a refusal that says which file and how, and
a check that every file present is one the manifest lists (model-signing leaves out files the
manifest's own ``ignore_paths`` names, and by default git's).

model-signing (and sigstore under it) is imported on first use: it is the ``fleet`` extra, and
its import costs more than the daemon's cold start should pay for a device without bundles.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edged.fleet.bundle_base import MAX_SIGNATURE_BYTES, SIGNATURE, BundleRefused, read_bounded
from edged.fleet.bundle_files import digest_files
from edged.fleet.trust import Trust, certificate_subject, check_private_key

log = logging.getLogger(__name__)

_PREDICATE = "https://model_signing/signature/v1.0"
_LISTED = 5  # files named in one refusal


@dataclass(frozen=True)
class Verified:
    signer: str  # "sha256:<key fingerprint>" or the signing certificate's subject
    files: dict[str, str]  # relative path -> sha256 hex, as signed


def _hashing() -> Any:
    from model_signing import hashing

    # git's files are signed like any other: a bundle is not a repository.
    return (
        hashing.Config()
        .use_file_serialization(hashing_algorithm="sha256", allow_symlinks=False)
        .set_ignored_paths(paths=[SIGNATURE], ignore_git_paths=False)
    )


def sign_bundle(root: Path, private_key: Path, *, certificate: Path | None = None, chain: Sequence[Path] = ()) -> Path:
    """Write ``root/bundle.sig`` over every other file of ``root``, with an EC private key (PEM),
    or with it, its signing certificate and ``chain``: the certificates from the issuer up to the
    root, which the signature carries so that a device needs only the root in fleet.trust."""
    from model_signing import signing

    if certificate is not None and not chain:
        raise ValueError("a certificate signature needs the chain of its issuers up to the root")
    check_private_key(private_key)

    config = signing.Config().set_hashing_config(_hashing())
    if certificate is None:
        config.use_elliptic_key_signer(private_key=private_key)
    else:
        config.use_certificate_signer(private_key=private_key, signing_certificate=certificate, certificate_chain=chain)
    sig = root / SIGNATURE
    sig.unlink(missing_ok=True)
    config.sign(root, sig)
    log.info("signed bundle %s", root, extra={"phase": "bundle"})
    return sig


def verify_signature(root: Path, trust: Trust, present: Sequence[str]) -> Verified:
    """Check ``root/bundle.sig`` against ``trust`` and the files ``present`` (every file of the
    folder but the signature); a BundleRefused says what failed."""
    from model_signing import verifying

    doc = _read_signature(root / SIGNATURE)
    material = doc.get("verificationMaterial") or {}
    statement = _statement(doc)
    config = verifying.Config().set_hashing_config(_hashing())
    hint = (material.get("publicKey") or {}).get("hint")
    chain = (material.get("x509CertificateChain") or {}).get("certificates")
    if hint:
        key = trust.key(hint)
        if key is None:
            raise BundleRefused(
                f"{SIGNATURE}: signed by key sha256:{hint}, which fleet.trust does not hold"
                f" (it holds {trust.describe()})",
                "untrusted_signer",
            )
        config.use_elliptic_key_verifier(public_key=key.path)
        signer = f"sha256:{hint}"
    elif chain:
        signer = _subject(chain)
        if not trust.certificates:
            raise BundleRefused(
                f"{SIGNATURE}: signed with certificate {signer}; fleet.trust holds no certificate", "untrusted_signer"
            )
        config.use_certificate_verifier(certificate_chain=trust.certificates)
    else:
        raise BundleRefused(f"{SIGNATURE}: names neither a key nor a certificate", "signature_malformed")
    _run(config, root, signer, statement, present)
    signed = _resources(statement)
    extra = sorted(set(present) - set(signed))
    if extra:
        raise BundleRefused(f"{_names(extra)}: not covered by the signature", "file_added")
    return Verified(signer, signed)


def claimed_signer(root: Path) -> str | None:
    """Who the signature says signed it, unverified (``edged bundle inspect``); None unsigned."""
    if not (root / SIGNATURE).is_file():
        return None
    material = _read_signature(root / SIGNATURE).get("verificationMaterial") or {}
    hint = (material.get("publicKey") or {}).get("hint")
    chain = (material.get("x509CertificateChain") or {}).get("certificates")
    if hint:
        return f"sha256:{hint}"
    return _subject(chain) if chain else None


def _run(config: Any, root: Path, signer: str, statement: dict[str, Any], present: Sequence[str]) -> None:
    from cryptography.exceptions import InvalidSignature
    from OpenSSL.crypto import X509StoreContextError

    try:
        config.verify(root, root / SIGNATURE)
    except InvalidSignature:
        raise BundleRefused(f"{SIGNATURE}: the signature does not verify with {signer}", "signature_invalid") from None
    except X509StoreContextError as e:
        raise BundleRefused(
            f"{SIGNATURE}: certificate {signer} does not chain to a certificate of fleet.trust: {e}", "untrusted_signer"
        ) from None
    except ValueError as e:
        if str(e).startswith("Signature mismatch"):
            # The signature itself verified (model-signing checks it first): the files differ.
            raise _file_difference(root, _resources(statement), present) from None
        code = "untrusted_signer" if "cannot be used for signing" in str(e) else "signature_malformed"
        raise BundleRefused(f"{SIGNATURE}: {e}", code) from None
    except (KeyError, TypeError, binascii.Error) as e:
        raise BundleRefused(f"{SIGNATURE}: unreadable: {e!r}", "signature_malformed") from None


def _file_difference(root: Path, signed: dict[str, str], present: Sequence[str]) -> BundleRefused:
    missing = sorted(set(signed) - set(present))
    if missing:
        return BundleRefused(f"{_names(missing)}: signed but missing from the bundle", "file_missing")
    added = sorted(set(present) - set(signed))
    if added:
        return BundleRefused(f"{_names(added)}: not covered by the signature", "file_added")
    actual = digest_files(root, present)
    changed = sorted(rel for rel, digest in actual.items() if signed.get(rel) != digest)
    return BundleRefused(f"{_names(changed)}: content differs from the signed digest", "file_modified")


def _names(rels: list[str]) -> str:
    shown = ", ".join(rels[:_LISTED])
    return shown + (f" and {len(rels) - _LISTED} more" if len(rels) > _LISTED else "")


def _read_signature(path: Path) -> dict[str, Any]:
    data = read_bounded(path, MAX_SIGNATURE_BYTES, SIGNATURE, "signature_malformed")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise BundleRefused(f"{SIGNATURE}: not JSON: {e}", "signature_malformed") from None
    if not isinstance(doc, dict):
        raise BundleRefused(f"{SIGNATURE}: not a Sigstore bundle", "signature_malformed")
    return doc


def _statement(doc: dict[str, Any]) -> dict[str, Any]:
    """The signed statement, read before the signature is checked only to choose the refusal;
    nothing of it is used unless the signature verifies."""
    try:
        st = json.loads(base64.b64decode(doc["dsseEnvelope"]["payload"], validate=True))
        ser = st["predicate"]["serialization"]
        _resources(st)
    except (KeyError, TypeError, ValueError, binascii.Error) as e:
        raise BundleRefused(f"{SIGNATURE}: no model-signing statement in it: {e!r}", "signature_malformed") from None
    if st.get("predicateType") != _PREDICATE or ser.get("method") != "files" or ser.get("hash_type") != "sha256":
        raise BundleRefused(
            f"{SIGNATURE}: edged reads model-signing v1.0 signatures of whole files with sha256, "
            f"not {st.get('predicateType')} {ser.get('method')}/{ser.get('hash_type')}",
            "signature_malformed",
        )
    return dict(st)


def _resources(statement: dict[str, Any]) -> dict[str, str]:
    return {str(r["name"]): str(r["digest"]) for r in statement["predicate"]["resources"]}


def _subject(chain: list[dict[str, Any]]) -> str:
    try:
        return certificate_subject(base64.b64decode(chain[0]["rawBytes"], validate=True))
    except (KeyError, TypeError, ValueError, binascii.Error) as e:
        raise BundleRefused(
            f"{SIGNATURE}: its signing certificate is unreadable: {e!r}", "signature_malformed"
        ) from None
