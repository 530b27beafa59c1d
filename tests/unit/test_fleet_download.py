"""Bundle downloads against a real HTTP server: Range resumes, the digest decides, sizes are
bounded, a local path is copied, and a cancelled download stops."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from edged.fleet import download
from edged.fleet.desired import Target
from tests.bundle_server import bundle_server

DATA = bytes(range(256)) * 400  # 100 KiB


def target(url: str, data: bytes = DATA, size: int = 0) -> Target:
    return Target(url, hashlib.sha256(data).hexdigest(), "1.0", size)


def fetch(t: Target, area: Path, max_bytes: int = 1 << 20) -> Path:
    return download.fetch(t, area, download.Limits(max_bytes, 5.0), threading.Event(), lambda done, total: None)


def test_a_partial_download_resumes_with_a_range_request(tmp_path: Path) -> None:
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "b.tar").write_bytes(DATA)
    t = target("")
    part = tmp_path / "area" / "partial" / f"{t.sha256}.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(DATA[:30000])  # what a device had before it rebooted
    with bundle_server(tmp_path / "srv") as srv:
        got = fetch(target(srv.url("b.tar")), tmp_path / "area")
        assert srv.ranges("b.tar") == ["bytes=30000-"]
        assert srv.sent("b.tar") == len(DATA) - 30000
    assert got.read_bytes() == DATA and not part.exists()
    assert fetch(target("http://127.0.0.1:1/gone.tar"), tmp_path / "area") == got  # placed: not fetched again


def test_a_wrong_digest_is_refused_and_the_partial_file_is_dropped(tmp_path: Path) -> None:
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "b.tar").write_bytes(DATA[:-1] + b"\x00")  # one byte differs
    with bundle_server(tmp_path / "srv") as srv, pytest.raises(download.DownloadError) as e:
        fetch(target(srv.url("b.tar")), tmp_path / "area")
    assert e.value.code == "digest"
    assert not list((tmp_path / "area").rglob("*.part")) and not list((tmp_path / "area").rglob("*.bundle"))


def test_sizes_are_bounded_announced_or_received(tmp_path: Path) -> None:
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "b.tar").write_bytes(DATA)
    with bundle_server(tmp_path / "srv") as srv:
        with pytest.raises(download.DownloadError) as e:
            fetch(target(srv.url("b.tar")), tmp_path / "area", max_bytes=50_000)
        assert e.value.code == "too_large"
        with pytest.raises(download.DownloadError) as e:  # the desired state's size is a bound too
            fetch(target(srv.url("b.tar"), size=1000), tmp_path / "area")
        assert e.value.code == "too_large"
        with pytest.raises(download.DownloadError) as e:
            fetch(target(srv.url("missing.tar")), tmp_path / "area")
        assert e.value.code == "http"


def test_a_local_path_is_copied_and_checked(tmp_path: Path) -> None:
    src = tmp_path / "b.tar"
    src.write_bytes(DATA)
    assert fetch(target(str(src)), tmp_path / "area").read_bytes() == DATA
    with pytest.raises(download.DownloadError) as e:
        fetch(target(str(tmp_path)), tmp_path / "area2")
    assert e.value.code == "not_found"


def test_a_cancelled_download_stops_and_keeps_what_arrived(tmp_path: Path) -> None:
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "b.tar").write_bytes(DATA)
    cancel = threading.Event()

    def progress(done: int, total: int) -> None:
        if done >= 20000:
            cancel.set()

    with bundle_server(tmp_path / "srv") as srv:
        srv.pace["b.tar"] = 200_000
        with pytest.raises(download.Cancelled):
            download.fetch(target(srv.url("b.tar")), tmp_path / "area", download.Limits(1 << 20), cancel, progress)
    part = next((tmp_path / "area" / "partial").glob("*.part"))
    assert 20000 <= part.stat().st_size < len(DATA)


def test_prune_keeps_the_named_digests_only(tmp_path: Path) -> None:
    keep, drop = "a" * 64, "b" * 64
    for sha in (keep, drop):
        download.archive_path(tmp_path, sha).parent.mkdir(parents=True, exist_ok=True)
        download.archive_path(tmp_path, sha).write_bytes(b"x")
        (tmp_path / "bundles" / f"m-{sha[:16]}").mkdir(parents=True)
    (tmp_path / "bundles" / f".m-{drop[:16]}.partial-1").mkdir()
    download.prune(tmp_path, {keep})
    assert sorted(p.name for p in (tmp_path / "bundles").iterdir()) == [f".m-{drop[:16]}.partial-1", f"m-{keep[:16]}"]
    assert [p.name for p in (tmp_path / "archives").iterdir()] == [f"{keep}.bundle"]
