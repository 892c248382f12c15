"""Durable JSONL streams: flushed appends, torn-tail repair, damage named."""

import subprocess
import sys

import pytest

from eagle3.records import JsonlAppender, RecordFileError, read_records, repair_torn_tail


def test_every_append_is_on_disk_before_close(tmp_path):
    path = tmp_path / "s.jsonl"
    writer = JsonlAppender(path, fsync_every=100)
    writer.append({"id": "a"})
    writer.append({"id": "b", "text": "ünï"})
    # another reader sees both records while the writer is still open
    assert [r["id"] for r in read_records(path)] == ["a", "b"]
    writer.close()


def test_records_survive_sigkill_of_the_writer(tmp_path):
    path = tmp_path / "s.jsonl"
    code = (
        "import os, signal, sys\n"
        "from eagle3.records import JsonlAppender\n"
        "w = JsonlAppender(sys.argv[1], fsync_every=1000)\n"
        "for i in range(50): w.append({'id': i})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)])
    assert proc.returncode == -9
    assert [r["id"] for r in read_records(path)] == list(range(50))


def test_torn_last_line_is_cut_and_named(tmp_path, caplog):
    path = tmp_path / "s.jsonl"
    path.write_bytes(b'{"id": 1}\n{"id": 2}\n{"id": 3, "tex')
    assert [r["id"] for r in read_records(path)] == [1, 2]
    assert path.read_bytes() == b'{"id": 1}\n{"id": 2}\n'
    assert "removed a torn last line (14 bytes)" in caplog.text
    with JsonlAppender(path) as w:
        w.append({"id": 3})
    assert [r["id"] for r in read_records(path)] == [1, 2, 3]


def test_torn_only_line_and_long_tail(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_bytes(b'{"id": "x' + b"y" * 3_000_000)
    assert repair_torn_tail(path) == 3_000_009
    assert path.read_bytes() == b""
    path.write_bytes(b'{"id": 1}\n' + b"z" * 2_500_000)
    assert read_records(path) == [{"id": 1}]


def test_damage_inside_the_file_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"id": 1}\nnot json\n{"id": 3}\n')
    with pytest.raises(RecordFileError, match=r"s\.jsonl:2: damaged record"):
        read_records(path)


def test_missing_file_has_no_records(tmp_path):
    assert read_records(tmp_path / "nope.jsonl") == []


def test_an_fsync_behind_runs_every_n_records_and_its_failure_is_raised(tmp_path, monkeypatch):
    """sync_behind: the due fsync runs in a worker thread, one at a time; a failure there is raised by
    the next append and by close (so no completion marker can follow it), naming the file."""
    import asyncio
    import errno
    import os

    import eagle3.records as records_module
    from eagle3.durable import DiskWriteError

    synced, real = [], os.fsync

    def fsync(fd):
        synced.append(fd)
        if len(synced) > 1:
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(records_module.os, "fsync", fsync)
    path = tmp_path / "s.jsonl"

    async def run():
        writer = JsonlAppender(path, fsync_every=2)
        due = [writer.append({"id": i}, sync=False) for i in range(2)]
        assert due == [False, True]
        writer.sync_behind()
        writer.sync_behind()  # one at a time: no second fsync while the first runs
        while writer._behind is not None:
            await asyncio.sleep(0.01)
        assert len(synced) == 1
        writer.append({"id": 2}, sync=False)
        writer.append({"id": 3}, sync=False)
        writer.sync_behind()
        while writer._behind is not None:
            await asyncio.sleep(0.01)
        with pytest.raises(DiskWriteError, match=r"s\.jsonl failed: Input/output error"):
            writer.append({"id": 4}, sync=False)
        with pytest.raises(DiskWriteError, match=r"s\.jsonl failed: Input/output error"):
            writer.close()
        assert writer.closed

    asyncio.run(run())
    assert [r["id"] for r in read_records(path)] == [0, 1, 2, 3]


def test_a_record_line_is_the_compact_utf8_json_of_the_record(tmp_path):
    import json

    path = tmp_path / "s.jsonl"
    record = {"id": "p-1", "ids": [1, 2, 3], "text": 'ünï "quoted"\n', "x": 0.25, "none": None, "n": {1: "a"}}
    with JsonlAppender(path) as writer:
        writer.append(record)
    line = path.read_bytes()
    assert line == (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    assert json.loads(line) == {**record, "n": {"1": "a"}}


def test_fsyncs_are_spaced_by_the_minimum_interval(tmp_path, monkeypatch):
    """With fsync_min_interval_s an fsync falls due after fsync_every records *and* that long since the
    last one: a fast stream syncs a few times a second, a slow one every fsync_every records."""
    import eagle3.records as records_module

    now = [100.0]
    monkeypatch.setattr(records_module.time, "monotonic", lambda: now[0])
    synced = []
    monkeypatch.setattr(records_module.os, "fsync", lambda fd: synced.append(now[0]))
    with JsonlAppender(tmp_path / "s.jsonl", fsync_every=2, fsync_min_interval_s=0.25) as writer:
        for _ in range(6):  # fast: six records in 0.1 s, none due
            now[0] += 0.02
            assert not writer.append({"id": "x"}, sync=False)
        now[0] += 0.2
        assert writer.append({"id": "y"})  # 0.32 s after opening, 7 unsynced: due, synced in line
        assert synced == [now[0]]
        due = []
        for k in range(4):  # slow: a second between records, so every second record is due
            now[0] += 1.0
            due.append(writer.append({"id": k}))
        assert due == [False, True, False, True] and len(synced) == 3
    assert len(synced) == 3, "close syncs only what is unsynced"
    with JsonlAppender(tmp_path / "t.jsonl", fsync_every=2) as writer:  # no interval: every 2 records
        assert [writer.append({"id": k}, sync=False) for k in range(4)] == [False, True, True, True]
