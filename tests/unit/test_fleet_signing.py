"""Bundles signed and verified for real with model-signing and keys made in a tmp dir: every
way a bundle can differ from what was signed is refused with the file or the key named."""

from __future__ import annotations

import datetime as dt
import hashlib
from pathlib import Path

import pytest

from edged.fleet.bundle import BundleRefused, open_bundle, parse_version, sign_bundle
from tests.fleet_keys import KeyPair, make_chain, make_key, tiny_bundle


@pytest.fixture
def key(tmp_path: Path) -> KeyPair:
    return make_key(tmp_path, "release")


@pytest.fixture
def signed(tmp_path: Path, key: KeyPair) -> Path:
    root = tiny_bundle(tmp_path)
    sign_bundle(root, key.private)
    return root


def refused(root: Path, trust: list[Path], require_signed: bool = True) -> BundleRefused:
    with pytest.raises(BundleRefused) as info:
        open_bundle(root, trust, require_signed=require_signed)
    return info.value


def test_a_signed_bundle_opens_with_its_metadata_files_and_signer(signed: Path, key: KeyPair) -> None:
    b = open_bundle(signed, [key.public], require_signed=True)
    assert b.signed and b.name == "tiny" and b.version == "1.0.0"
    fingerprint = hashlib.sha256(key.public.read_bytes()).hexdigest()
    assert b.signer == f"sha256:{fingerprint}"
    assert set(b.files) == {"bundle.toml", "model.toml", "model.onnx", "calibration/0.npy", "calibration/1.npy"}
    assert b.files["model.onnx"] == hashlib.sha256((signed / "model.onnx").read_bytes()).hexdigest()
    assert Path(b.model_config.path) == signed.resolve() / "model.onnx"
    assert b.model_config.calibration is not None
    assert Path(b.model_config.calibration.data) == signed.resolve() / "calibration"
    assert b.created.tzinfo is not None and b.created <= dt.datetime.now(dt.timezone.utc)


def test_one_byte_changed_in_one_file_is_refused_naming_it(signed: Path, key: KeyPair) -> None:
    sample = signed / "calibration" / "1.npy"
    data = bytearray(sample.read_bytes())
    data[10] ^= 1
    sample.write_bytes(bytes(data))
    err = refused(signed, [key.public])
    assert err.code == "file_modified" and "calibration/1.npy" in err.reason


def test_an_added_file_is_refused(signed: Path, key: KeyPair) -> None:
    (signed / "calibration" / "2.npy").write_bytes(b"extra")
    err = refused(signed, [key.public])
    assert err.code == "file_added" and "calibration/2.npy" in err.reason


def test_a_git_file_added_is_refused_though_model_signing_ignores_git_by_default(signed: Path, key: KeyPair) -> None:
    (signed / ".gitignore").write_text("*\n")
    err = refused(signed, [key.public])
    assert err.code == "file_added" and ".gitignore" in err.reason


def test_a_removed_file_is_refused(signed: Path, key: KeyPair) -> None:
    (signed / "calibration" / "0.npy").unlink()
    err = refused(signed, [key.public])
    assert err.code == "file_missing" and "calibration/0.npy" in err.reason


def test_the_metadata_is_signed_so_a_version_edit_is_refused(signed: Path, key: KeyPair) -> None:
    meta = signed / "bundle.toml"
    meta.write_text(meta.read_text().replace('version = "1.0.0"', 'version = "9.0.0"'))
    err = refused(signed, [key.public])
    assert err.code == "file_modified" and "bundle.toml" in err.reason


def test_a_key_that_fleet_trust_does_not_hold_is_refused_naming_the_key(
    tmp_path: Path, signed: Path, key: KeyPair
) -> None:
    other = make_key(tmp_path, "other")
    err = refused(signed, [other.public])
    fingerprint = hashlib.sha256(key.public.read_bytes()).hexdigest()
    assert err.code == "untrusted_signer" and fingerprint in err.reason and "other.pub" in err.reason


def test_a_signature_made_by_another_key_under_the_trusted_hint_is_invalid(
    tmp_path: Path, signed: Path, key: KeyPair
) -> None:
    # Resigned by another key, then given the trusted key's hint: the signature itself fails.
    other = make_key(tmp_path, "other")
    sign_bundle(signed, other.private)
    sig = signed / "bundle.sig"
    sig.write_text(
        sig.read_text().replace(
            hashlib.sha256(other.public.read_bytes()).hexdigest(), hashlib.sha256(key.public.read_bytes()).hexdigest()
        )
    )
    err = refused(signed, [key.public])
    assert err.code == "signature_invalid"


def test_a_garbled_signature_is_malformed(signed: Path, key: KeyPair) -> None:
    (signed / "bundle.sig").write_text("{not json")
    assert refused(signed, [key.public]).code == "signature_malformed"


def test_an_unsigned_bundle_opens_only_when_signatures_are_not_required(tmp_path: Path, key: KeyPair) -> None:
    root = tiny_bundle(tmp_path)
    b = open_bundle(root, [key.public], require_signed=False)
    assert not b.signed and b.signer is None and "model.onnx" in b.files
    err = refused(root, [key.public], require_signed=True)
    assert err.code == "unsigned"


def test_a_tampered_signed_bundle_is_refused_even_when_signatures_are_optional(signed: Path, key: KeyPair) -> None:
    (signed / "extra.bin").write_bytes(b"x")
    assert refused(signed, [key.public], require_signed=False).code == "file_added"


def test_a_certificate_chain_verifies_offline_against_the_trusted_root(tmp_path: Path) -> None:
    chain = make_chain(tmp_path, "fleet")
    root = tiny_bundle(tmp_path)
    sign_bundle(root, chain.key, certificate=chain.leaf, chain=[chain.root])
    b = open_bundle(root, [chain.root], require_signed=True)
    assert b.signed and b.signer == "CN=fleet signer,O=edged"


def test_a_certificate_from_another_root_is_refused(tmp_path: Path) -> None:
    chain, other = make_chain(tmp_path, "fleet"), make_chain(tmp_path, "rogue")
    root = tiny_bundle(tmp_path)
    sign_bundle(root, other.key, certificate=other.leaf, chain=[other.root])
    err = refused(root, [chain.root])
    assert err.code == "untrusted_signer" and "rogue signer" in err.reason


def test_a_certificate_not_meant_for_signing_is_refused(tmp_path: Path) -> None:
    chain = make_chain(tmp_path, "fleet", signing=False)
    root = tiny_bundle(tmp_path)
    sign_bundle(root, chain.key, certificate=chain.leaf, chain=[chain.root])
    assert refused(root, [chain.root]).code == "untrusted_signer"


def test_a_certificate_signed_bundle_is_refused_when_only_keys_are_trusted(tmp_path: Path, key: KeyPair) -> None:
    chain = make_chain(tmp_path, "fleet")
    root = tiny_bundle(tmp_path)
    sign_bundle(root, chain.key, certificate=chain.leaf, chain=[chain.root])
    err = refused(root, [key.public])
    assert err.code == "untrusted_signer" and "holds no certificate" in err.reason


def test_a_trust_file_that_is_no_key_is_refused_naming_it(signed: Path, tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("hello")
    err = refused(signed, [junk])
    assert err.code == "trust_invalid" and "junk.pem" in err.reason


def test_versions_compare_as_releases_not_as_text() -> None:
    assert parse_version("1.10.0") > parse_version("1.9.3")
    assert parse_version("2026.6.1") > parse_version("2026.6")
    with pytest.raises(ValueError):
        parse_version("latest")
