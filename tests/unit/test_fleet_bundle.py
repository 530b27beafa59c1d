"""A bundle's folder and archive checked before anything is trusted: tar traversal, links,
devices, duplicates, size and member bombs, and a model table that points outside."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from edged.fleet.bundle import BundleLimits, BundleRefused, open_bundle
from tests.fleet_keys import tiny_bundle


def refused(path: Path, **kw: object) -> BundleRefused:
    with pytest.raises(BundleRefused) as info:
        open_bundle(path, [], require_signed=False, **kw)  # type: ignore[arg-type]
    return info.value


def archive(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]], gz: bool = False) -> Path:
    with tarfile.open(path, "w:gz" if gz else "w") as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    return info


def bundle_members(root: Path, prefix: str = "") -> list[tuple[tarfile.TarInfo, bytes | None]]:
    return [
        (member(prefix + p.relative_to(root).as_posix()), p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    ]


def test_an_archive_of_a_bundle_opens_whether_it_holds_the_folder_or_its_contents(tmp_path: Path) -> None:
    root = tiny_bundle(tmp_path)
    flat = archive(tmp_path / "flat.tar.gz", bundle_members(root), gz=True)
    nested = archive(tmp_path / "nested.tar", bundle_members(root, "tiny-1.0.0/"))
    for path in (flat, nested):
        b = open_bundle(path, [], require_signed=False, extract_to=tmp_path / f"out-{path.name}")
        assert b.name == "tiny" and "model.onnx" in b.files
        assert b.root.is_relative_to((tmp_path / f"out-{path.name}").resolve())


def test_an_archive_extracts_beside_itself_by_default(tmp_path: Path) -> None:
    root = tiny_bundle(tmp_path)
    path = archive(tmp_path / "det-1.2.tar", bundle_members(root))
    assert open_bundle(path, [], require_signed=False).root == (tmp_path / "det-1.2").resolve()


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ((member("../evil"), b"x"), "'..'"),
        ((member("a/../../evil"), b"x"), "'..'"),
        ((member("/etc/evil"), b"x"), "relative"),
        ((member("link", tarfile.SYMTYPE, "/etc/passwd"), None), "symbolic link"),
        ((member("hard", tarfile.LNKTYPE, "model.toml"), None), "hard link"),
        ((member("dev", tarfile.CHRTYPE), None), "device"),
        ((member("pipe", tarfile.FIFOTYPE), None), "fifo"),
        ((member("model.toml"), b'path = "model.onnx"'), "twice"),
    ],
)
def test_an_unsafe_member_is_refused_and_nothing_is_left(
    tmp_path: Path, bad: tuple[tarfile.TarInfo, bytes | None], words: str
) -> None:
    root = tiny_bundle(tmp_path)
    path = archive(tmp_path / "bad.tar", [*bundle_members(root), bad])
    err = refused(path, extract_to=tmp_path / "out")
    assert err.code == "archive_unsafe" and words in err.reason
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial")]
    assert not (tmp_path.parent / "evil").exists()


def test_a_link_in_a_bundle_folder_is_refused(tmp_path: Path) -> None:
    root = tiny_bundle(tmp_path)
    (root / "calibration" / "2.npy").symlink_to("/etc/passwd")
    err = refused(root)
    assert err.code == "archive_unsafe" and "calibration/2.npy" in err.reason and "symbolic link" in err.reason


def test_a_fifo_in_a_bundle_folder_is_refused(tmp_path: Path) -> None:
    root = tiny_bundle(tmp_path)
    os.mkfifo(root / "pipe")
    assert refused(root).code == "archive_unsafe"


def test_bytes_over_the_limit_are_refused_before_extraction(tmp_path: Path) -> None:
    root = tiny_bundle(tmp_path)
    big = tarfile.TarInfo("big.bin")
    path = archive(tmp_path / "big.tar", [*bundle_members(root), (big, b"\0" * 100_000)], gz=True)
    err = refused(path, extract_to=tmp_path / "out", limits=BundleLimits(max_bytes=50_000, max_files=100))
    assert err.code == "too_large" and "fleet.max_bundle_size" in err.reason
    assert not (tmp_path / "out").exists()


def test_members_over_the_limit_are_refused(tmp_path: Path) -> None:
    root = tiny_bundle(tmp_path)
    many = [(member(f"f{i}"), b"") for i in range(50)]
    path = archive(tmp_path / "many.tar", [*bundle_members(root), *many])
    err = refused(path, extract_to=tmp_path / "out", limits=BundleLimits(max_bytes=1 << 30, max_files=20))
    assert err.code == "too_large" and "fleet.max_bundle_files" in err.reason


def test_a_folder_over_the_limits_is_refused(tmp_path: Path) -> None:
    root = tiny_bundle(tmp_path)
    assert refused(root, limits=BundleLimits(max_bytes=100, max_files=100)).code == "too_large"
    assert refused(root, limits=BundleLimits(max_bytes=1 << 30, max_files=3)).code == "too_large"


def test_an_existing_destination_is_not_overwritten(tmp_path: Path) -> None:
    root = tiny_bundle(tmp_path)
    path = archive(tmp_path / "b.tar", bundle_members(root))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("mine")
    assert refused(path, extract_to=tmp_path / "out").code == "archive_unsafe"
    assert (tmp_path / "out" / "keep").read_text() == "mine"


def test_a_file_that_is_not_a_tar_is_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "b.tar"
    path.write_bytes(b"not a tar at all" * 100)
    assert refused(path, extract_to=tmp_path / "out").code == "archive_unreadable"


def test_a_missing_bundle_is_not_found(tmp_path: Path) -> None:
    assert refused(tmp_path / "nowhere").code == "not_found"


@pytest.mark.parametrize(
    ("table", "words"),
    [
        ('path = "/etc/passwd"', "outside the bundle"),
        ('path = "../tiny.onnx"', "outside the bundle"),
        ('path = "model.onnx"\n[calibration]\ndata = "/var/lib"', "calibration.data"),
        ('path = "model.onnx"\n[warmup]\ninputs = "../x.npz"', "warmup.inputs"),
        ('path = "absent.onnx"', "not a file of the bundle"),
        ('path = "bundle.toml"', "ONNX or GGUF"),
        ('path = "model.onnx"\nprecision = "int9"', "models.tiny.precision"),
    ],
)
def test_a_model_table_that_reaches_outside_or_is_invalid_is_refused(tmp_path: Path, table: str, words: str) -> None:
    root = tiny_bundle(tmp_path)
    (root / "model.toml").write_text(table)
    err = refused(root)
    assert err.code == "config_invalid" and words in err.reason


@pytest.mark.parametrize(
    ("meta", "words"),
    [
        ('name = "tiny"\ncreated = 2026-01-01T00:00:00Z', "version"),
        ('name = "tiny"\nversion = "latest"\ncreated = 2026-01-01T00:00:00Z', "PEP 440"),
        ('name = "../x"\nversion = "1"\ncreated = 2026-01-01T00:00:00Z', "name"),
        ('name = "tiny"\nversion = "1"\ncreated = 2026-01-01T00:00:00', "time zone"),
        ('name = "tiny"\nversion = "1"\ncreated = 2026-01-01T00:00:00Z\nformat = 2', "format 2"),
    ],
)
def test_bad_metadata_is_refused(tmp_path: Path, meta: str, words: str) -> None:
    root = tiny_bundle(tmp_path)
    (root / "bundle.toml").write_text(meta)
    err = refused(root)
    assert err.code == "metadata_invalid" and words in err.reason


def test_a_folder_without_the_tables_is_not_a_bundle(tmp_path: Path) -> None:
    root = tiny_bundle(tmp_path)
    (root / "model.toml").unlink()
    assert refused(root).code == "not_a_bundle"
