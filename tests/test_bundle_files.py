"""What a bundle writer leaves on disk: nothing of a killed writer for long, no descriptor of a failed
write, and never anything a person or another live writer owns."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from nanscan.capture import bundle as B
from nanscan.capture import write as W

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(path, **over):
    kw = dict(batch={"args": [torch.ones(3)], "kwargs": {}, "single": True}, rng=B.capture_rng(),
              model_state={"w": torch.zeros(4)}, step=0)
    kw.update(over)
    return B.write_bundle(str(path), **kw)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def _leftovers(directory):
    return sorted(n for n in os.listdir(directory) if ".tmp-" in n)


def test_a_killed_writers_temporary_directory_is_removed_by_the_next_write(tmp_path):
    # The writer is SIGKILLed after its first file: what the out-of-memory killer or a preempted node does.
    r = _run(f"""
        import os, signal, torch
        from nanscan.capture import bundle as B, write as W
        real = W._save
        def save_then_die(obj, target):
            real(obj, target)
            os.kill(os.getpid(), signal.SIGKILL)
        W._save = save_then_die
        B.write_bundle({str(tmp_path / "step000003-rank0")!r}, batch={{"args": [torch.ones(1 << 16)], "kwargs": {{}},
                       "single": True}}, rng=B.capture_rng(), model_state={{"w": torch.zeros(1 << 16)}}, step=3)
        """)
    assert r.returncode == -signal.SIGKILL, r.stderr
    stale = _leftovers(tmp_path)
    assert len(stale) == 1 and os.listdir(tmp_path / stale[0]) == ["batch.pt"]

    written = _write(tmp_path / "step000004-rank0")
    assert _leftovers(tmp_path) == [] and sorted(os.listdir(tmp_path)) == ["step000004-rank0"]
    assert B.load_bundle(written).manifest["step"] == 0


def test_a_live_writers_directory_is_never_touched(tmp_path):
    # Another rank on this host still writing: its pid exists, so its directory stays and is no leftover.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".step000001-rank1.tmp-p{other.pid}-h{W._host_tag()}-abc123_x"
        live.mkdir()
        (live / "batch.pt").write_bytes(b"partial")
        removed, left = B.clean_stale_temp_dirs(str(tmp_path))
        assert (removed, left) == ([], [])
        _write(tmp_path / "step000001-rank0")
        assert (live / "batch.pt").read_bytes() == b"partial"
    finally:
        other.kill()
        other.wait()
    # Now it is dead: the next write removes it.
    _write(tmp_path / "step000002-rank0")
    assert not live.exists()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_leftovers_this_host_cannot_judge_are_kept_and_named(tmp_path):
    foreign = (tmp_path / f".step000001-rank3.tmp-p{_dead_pid()}"
               f"-h{'0' * 8 if W._host_tag() != '0' * 8 else '1' * 8}-q1w2e3r4")
    old_style = tmp_path / ".step000001-rank0.tmp-k2j3h4g5"  # named before writers put their pid in it
    user_owned = tmp_path / f".step000001-rank2.tmp-p{_dead_pid()}-h{W._host_tag()}-zzzzzzzz"
    for d in (foreign, old_style, user_owned):
        d.mkdir()
        (d / "model.pt").write_bytes(b"x")
    (user_owned / "notes.txt").write_text("mine")  # something nanscan never writes: not ours to delete
    with pytest.warns(RuntimeWarning, match="3 temporary bundle directories") as record:
        _write(tmp_path / "step000009-rank0")
    message = str(record[0].message)
    assert all(str(d) in message for d in (foreign, old_style, user_owned))
    assert "remove these by hand" in message
    assert foreign.exists() and old_style.exists() and (user_owned / "notes.txt").read_text() == "mine"


def test_a_failed_write_closes_its_file_at_once(tmp_path):
    # A real failed write: a file-size limit makes write(2) fail with EFBIG, as a full disk fails it
    # with ENOSPC. The error (and so its traceback) is still held when the descriptors are listed.
    r = _run(f"""
        import os, resource, signal, torch
        from nanscan.capture import bundle as B
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        try:
            B.write_bundle({str(tmp_path / "b")!r}, batch={{"args": [torch.ones(4)], "kwargs": {{}}, "single": True}},
                           rng=B.capture_rng(), model_state={{"w": torch.zeros(1 << 20)}}, step=0)
        except B.BundleWriteError as e:
            held = e
        else:
            raise SystemExit("the write did not fail")
        fds = [os.readlink(f"/proc/self/fd/{{fd}}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{{fd}}")]
        open_here = [f for f in fds if f.startswith({str(tmp_path)!r})]
        print("OPEN", open_here)
        print("LEFT", os.listdir({str(tmp_path)!r}))
        """)
    assert r.returncode == 0, r.stderr
    assert "OPEN []" in r.stdout and "LEFT []" in r.stdout, r.stdout
