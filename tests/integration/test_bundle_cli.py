"""``edged bundle sign|verify|inspect`` as an operator runs them: the real command in a
subprocess, real keys, a real tar archive; exit 0 only when every file verifies."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.fleet_keys import KeyPair, make_chain, make_key, tiny_bundle

pytestmark = pytest.mark.integration


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edged", "bundle", *map(str, args)],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=120,
    )


def signed_bundle(tmp_path: Path) -> tuple[Path, KeyPair]:
    key = make_key(tmp_path, "release")
    root = tiny_bundle(tmp_path)
    out = cli("sign", root, "--key", key.private)
    assert out.returncode == 0, out.stderr
    assert "signed tiny 1.0.0: 5 files" in out.stdout and (root / "bundle.sig").is_file()
    return root, key


def test_sign_then_verify_exits_0_and_names_the_signer(tmp_path: Path) -> None:
    root, key = signed_bundle(tmp_path)
    out = cli("verify", root, "--trust", key.public)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("verified tiny 1.0.0: 5 files, signed by sha256:")


def test_verify_exits_1_with_the_reason_for_a_tampered_file(tmp_path: Path) -> None:
    root, key = signed_bundle(tmp_path)
    model = root / "model.onnx"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF
    model.write_bytes(bytes(data))
    out = cli("verify", root, "--trust", key.public)
    assert out.returncode == 1
    assert "refused (file_modified): model.onnx" in out.stderr


def test_verify_exits_1_for_a_wrong_key_and_for_an_unsigned_bundle(tmp_path: Path) -> None:
    root, _ = signed_bundle(tmp_path)
    other = make_key(tmp_path, "other")
    out = cli("verify", root, "--trust", other.public)
    assert out.returncode == 1 and "untrusted_signer" in out.stderr
    unsigned = tiny_bundle(tmp_path, version="2.0.0")
    out = cli("verify", unsigned, "--trust", other.public)
    assert out.returncode == 1 and "refused (unsigned)" in out.stderr


def test_verify_reads_an_archive_and_leaves_nothing_behind(tmp_path: Path) -> None:
    root, key = signed_bundle(tmp_path)
    archive = tmp_path / "tiny-1.0.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(root, arcname="tiny-1.0.0")
    before = sorted(tmp_path.iterdir())
    out = cli("verify", archive, "--trust", key.public)
    assert out.returncode == 0, out.stderr
    assert sorted(tmp_path.iterdir()) == before


def test_a_certificate_signed_bundle_verifies_against_its_root(tmp_path: Path) -> None:
    chain = make_chain(tmp_path, "fleet")
    root = tiny_bundle(tmp_path)
    out = cli("sign", root, "--key", chain.key, "--certificate", chain.leaf, "--chain", chain.root)
    assert out.returncode == 0, out.stderr
    out = cli("verify", root, "--trust", chain.root)
    assert out.returncode == 0, out.stderr
    assert "signed by CN=fleet signer,O=edged" in out.stdout


def test_inspect_shows_name_version_files_digests_and_the_claimed_signer(tmp_path: Path) -> None:
    root, key = signed_bundle(tmp_path)
    out = cli("inspect", root, "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["name"] == "tiny" and info["version"] == "1.0.0" and info["model"] == "model.onnx"
    assert info["signer"] == "sha256:" + hashlib.sha256(key.public.read_bytes()).hexdigest()
    assert set(info["files"]) == {"bundle.toml", "model.toml", "model.onnx", "calibration/0.npy", "calibration/1.npy"}
    text = cli("inspect", root)
    assert text.returncode == 0 and "(claimed" in text.stdout and info["files"]["model.onnx"] in text.stdout
    assert text.stderr == ""


def test_sign_refuses_a_broken_bundle_and_a_missing_key(tmp_path: Path) -> None:
    key = make_key(tmp_path, "release")
    root = tiny_bundle(tmp_path)
    (root / "model.toml").write_text('path = "/etc/passwd"')
    out = cli("sign", root, "--key", key.private)
    assert out.returncode == 1 and "config_invalid" in out.stderr and not (root / "bundle.sig").exists()
    out = cli("sign", root, "--key", tmp_path / "absent.pem")
    assert out.returncode == 2 and "absent.pem" in out.stderr


def test_sign_refuses_a_key_that_is_not_ec_with_a_clear_message(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    rsa_key = tmp_path / "rsa.pem"
    rsa_key.write_bytes(
        rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    root = tiny_bundle(tmp_path)
    out = cli("sign", root, "--key", rsa_key)
    assert out.returncode == 2 and "not an EC private key" in out.stderr and "Traceback" not in out.stderr


def model_signing_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "model_signing", *map(str, args)], capture_output=True, text=True, timeout=120
    )


def test_bundles_interoperate_with_model_signings_own_command(tmp_path: Path) -> None:
    key = make_key(tmp_path, "release")
    theirs = tiny_bundle(tmp_path, version="1.0.0")
    sig = theirs / "bundle.sig"
    out = model_signing_cli("sign", "key", theirs, "--private_key", key.private, "--signature", sig)
    assert out.returncode == 0, out.stderr
    out = cli("verify", theirs, "--trust", key.public)
    assert out.returncode == 0, out.stderr
    ours = tiny_bundle(tmp_path, version="2.0.0")
    out = cli("sign", ours, "--key", key.private)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    out = model_signing_cli("verify", "key", ours, "--public_key", key.public, "--signature", ours / "bundle.sig")
    assert out.returncode == 0, out.stderr + out.stdout
