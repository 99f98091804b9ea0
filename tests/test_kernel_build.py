"""Building and loading the CPU kernels (dflash_kernels/build.py) when the cache is not as it
should be: a damaged library, a folder that cannot be written, a compiler that fails. A fake
compiler stands in for g++ (a real build takes 20-60 s)."""

import os
import stat
import time

import pytest
from helpers import long_ago

from dflash_kernels import build

COMPILER = """#!/bin/sh
# Writes its -o file, or fails as an out-of-memory-killed cc1plus does (no line saying "error").
echo "$@" >> "$(dirname "$0")/calls"
if [ -f "$(dirname "$0")/fail" ]; then echo "cc1plus: internal compiler fault" >&2; echo "killed" >&2; exit 4; fi
while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then printf 'a whole library' > "$2"; fi; shift; done
"""


@pytest.fixture
def compiler(tmp_path):
    path = tmp_path / "bin" / "fake-g++"
    path.parent.mkdir()
    path.write_text(COMPILER)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def calls(compiler) -> int:
    """Compilations run (`--version` aside)."""
    log = compiler.parent / "calls"
    return sum(" -o " in f" {line} " for line in log.read_text().splitlines()) if log.exists() else 0


def test_a_build_leaves_a_whole_library_with_its_checksum_and_nothing_else(tmp_path, compiler):
    """Nor what killed builds left: their compilers went on and wrote a partial library each, for good
    (an audit)."""
    library = tmp_path / "key" / "dflash_kernels.so"
    library.parent.mkdir()
    (library.parent / f"{2**22 + 1}-a1b2c3.partial").write_bytes(b"half")  # a killed build's (no such pid)
    long_ago(library.parent / f"{2**22 + 1}-a1b2c3.partial")
    (library.parent / f"{os.getpid()}-d4e5f6.partial").write_bytes(b"half")  # a live build's: left to it
    build._compile(str(compiler), library)
    (library.parent / f"{os.getpid()}-d4e5f6.partial").unlink()
    assert library.read_bytes() == b"a whole library" and build._whole(library)
    assert sorted(p.name for p in library.parent.iterdir()) == ["dflash_kernels.sha256", "dflash_kernels.so"]
    # Loadable by the other users of a shared cache, as the umask allows (it was mkstemp's 0600).
    umask = os.umask(0)
    os.umask(umask)
    assert library.stat().st_mode & 0o777 == 0o755 & ~umask


def test_a_library_an_older_version_left_0711_is_mended_not_built_again(tmp_path, compiler, monkeypatch):
    """Built before the library was made as the umask allows, it stayed unloadable by the cache's
    other users after every upgrade (they fell back to torch's ops: an audit)."""
    monkeypatch.setattr(build, "KERNEL_CACHE", tmp_path / "kernels")
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setattr(build.torch.ops, "load_library", lambda path: None)
    library = build.load.__wrapped__() / "dflash_kernels.so"
    library.chmod(0o711)
    assert build.load.__wrapped__() == library.parent
    umask = os.umask(0)
    os.umask(umask)
    assert calls(compiler) == 1 and library.stat().st_mode & 0o777 == 0o755 & ~umask


def test_a_damaged_library_is_built_again_and_never_loaded(tmp_path, compiler, monkeypatch):
    """A truncated library (a full disk, a crash before write-back) was loaded as it was: every
    process died of a bus error, for good (an audit)."""
    monkeypatch.setattr(build, "KERNEL_CACHE", tmp_path / "kernels")
    monkeypatch.setenv("CXX", str(compiler))
    loaded = []
    monkeypatch.setattr(build.torch.ops, "load_library", lambda path: loaded.append(open(path, "rb").read()))
    folder = build.load.__wrapped__()
    library = folder / "dflash_kernels.so"
    assert loaded == [b"a whole library"] and calls(compiler) == 1
    library.write_bytes(b"a whole lib")  # truncated after its checksum was written
    build.load.__wrapped__()
    assert loaded[-1] == b"a whole library" and calls(compiler) == 2
    build.load.__wrapped__()  # whole: loaded as it is
    assert calls(compiler) == 2 and len(loaded) == 3


def test_a_whole_library_in_a_folder_no_one_may_write_loads_and_a_folder_that_cannot_be_made_says_why(
    tmp_path, compiler, monkeypatch
):
    """A read-only cache raised OSError from the lock file even with the library built, and the
    target and the drafter died with a traceback (an audit)."""
    monkeypatch.setattr(build, "KERNEL_CACHE", tmp_path / "kernels")
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setattr(build.torch.ops, "load_library", lambda path: None)
    build.load.__wrapped__()

    def refused(folder, work=""):
        raise OSError(30, "Read-only file system", str(folder / ".lock"))

    monkeypatch.setattr(build, "locked", refused)
    assert build.load.__wrapped__().is_dir()  # whole: no lock taken
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(build, "KERNEL_CACHE", blocker / "kernels")
    with pytest.raises(build.KernelsUnavailable, match="cannot build the kernels in"):
        build.load.__wrapped__()


@pytest.mark.parametrize("level", ["cache", "kernels", "key", "library"])
def test_kernels_in_a_place_any_user_may_write_are_never_loaded(tmp_path, compiler, monkeypatch, level):
    """A cache under a folder anyone may write (DFLASH_SPLIT_CACHE=/srv/shared, mode 1777): another
    user put a library there, with its checksum, and its code ran in every process that loaded
    the kernels (an audit). Group-writable is a group's shared cache, and loads."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(build, "KERNEL_CACHE", cache / "kernels")
    monkeypatch.setenv("CXX", str(compiler))
    loaded = []
    monkeypatch.setattr(build.torch.ops, "load_library", loaded.append)
    library = build.load.__wrapped__() / "dflash_kernels.so"
    where = {"cache": cache, "kernels": cache / "kernels", "key": library.parent, "library": library}[level]
    where.chmod(where.stat().st_mode | stat.S_IWGRP)
    build.load.__wrapped__()
    assert len(loaded) == 2
    where.chmod(where.stat().st_mode | stat.S_IWOTH | (stat.S_ISVTX if where.is_dir() else 0))  # sticky: no help
    with pytest.raises(build.KernelsUnavailable, match=f"any user may write {where} \\(chmod o-w"):
        build.load.__wrapped__()
    assert len(loaded) == 2 and calls(compiler) == 1


def test_kernels_under_a_folder_another_user_made_are_never_loaded(tmp_path, compiler, monkeypatch):
    """DFLASH_SPLIT_CACHE=/srv/shared/me, where another user made `me` first in the 1777 shared/:
    mode bits alone passed it, and that user's library loaded (a review). Its owner is checked."""
    if os.getuid() != 0:
        pytest.skip("making a folder another user's takes root")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # above the cache: the sticky bit keeps others' files theirs
    cache = shared / "me"
    monkeypatch.setattr(build, "KERNEL_CACHE", cache / "kernels")
    monkeypatch.setenv("CXX", str(compiler))
    loaded = []
    monkeypatch.setattr(build.torch.ops, "load_library", loaded.append)
    build.load.__wrapped__()
    assert len(loaded) == 1
    os.chown(cache, 65534, 65534)  # nobody's, as if it had made it first
    with pytest.raises(build.KernelsUnavailable, match=f"{cache} belongs to another user \\(uid 65534\\)"):
        build.load.__wrapped__()
    assert len(loaded) == 1


def test_a_failed_build_says_why_and_is_not_tried_again_by_every_start(tmp_path, compiler, monkeypatch):
    """A failure whose output had no line with "error" said nothing ("failed: "), and every daemon
    start compiled again for 20-60 s (an audit)."""
    (compiler.parent / "fail").write_text("")
    library = tmp_path / "key" / "dflash_kernels.so"
    library.parent.mkdir()
    with pytest.raises(build.KernelsUnavailable, match="internal compiler fault | killed"):
        build._compile(str(compiler), library)
    with pytest.raises(build.KernelsUnavailable, match="an earlier build"):
        build._compile(str(compiler), library)
    assert calls(compiler) == 1 and not list(library.parent.glob("*.partial"))
    # Dated an hour ahead (a clock stepped back, another host's clock on a shared disk): not younger
    # than now, so not an hour and ten minutes of no retries (an audit).
    ahead = time.time() + 3600
    os.utime(library.with_suffix(".failed"), (ahead, ahead))
    with pytest.raises(build.KernelsUnavailable, match="internal compiler fault | killed"):
        build._compile(str(compiler), library)
    assert calls(compiler) == 2
    os.utime(library.with_suffix(".failed"), (0, 0))  # long ago: tried again
    (compiler.parent / "fail").unlink()
    build._compile(str(compiler), library)
    assert calls(compiler) == 3 and build._whole(library) and not library.with_suffix(".failed").exists()


def test_a_measurement_runs_on_one_thread_and_a_folder_that_cannot_keep_it_costs_a_warning(
    tmp_path, monkeypatch, caplog
):
    """At two threads beside a busy core every option timed the same and the noise was kept for
    good; a read-only cache raised from the lock file (an audit)."""
    import torch

    import dflash_kernels

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        measure = lambda: seen.append(torch.get_num_threads()) or {"a": 1.0, "b": 2.0}  # noqa: E731
        assert dflash_kernels.measured_once(tmp_path, "choice", measure) == {"a": 1.0, "b": 2.0}
        assert dflash_kernels.measured_once(tmp_path, "choice", measure) == {"a": 1.0, "b": 2.0}  # kept
        assert seen == [1] and torch.get_num_threads() == 2

        def refused(folder, work=""):
            raise OSError(30, "Read-only file system")

        monkeypatch.setattr(dflash_kernels, "locked", refused)
        assert dflash_kernels.measured_once(tmp_path, "other", measure) == {"a": 1.0, "b": 2.0}
        assert seen == [1, 1] and "cannot keep the measurement other" in caplog.text
    finally:
        torch.set_num_threads(threads)


def test_a_cpu_proc_says_nothing_of_is_keyed_by_what_the_compiler_selects_for_it(tmp_path, monkeypatch):
    """Without /proc/cpuinfo the key fell back to platform.processor(), "" on Linux: one key for
    every CPU sharing a cache, whose -march=native builds another CPU could then load (an audit)."""
    script = tmp_path / "bin" / "g++"
    script.parent.mkdir()
    help_text = '  -march=  $(cat "$(dirname "$0")/cpu")\n  -mavx512bf16  [enabled]\n  -mamx-bf16  [disabled]'
    script.write_text(f'#!/bin/sh\nprintf "{help_text}\\n"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.setattr(build, "CPUINFO", tmp_path / "no-cpuinfo")
    keys = []
    for cpu in ("znver3", "sapphirerapids"):
        (script.parent / "cpu").write_text(cpu)
        build._native_target.cache_clear()
        keys.append(build.cpu_flags())
    build._native_target.cache_clear()
    assert keys[0] != keys[1] and "znver3" in keys[0]
    flags = keys[0].split()  # the bf16 options under /proc's names, which native_bf16 reads
    assert "avx512_bf16" in flags and "amx_bf16" not in flags and "-mamx-bf16" not in flags


def test_a_start_waiting_behind_another_build_says_so(tmp_path, caplog):
    """Behind a build stopped with Ctrl-Z, every daemon's start waited without a word (an audit)."""
    import threading

    from basics.files import locked

    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with locked(tmp_path, "build of the CPU kernels"):
            held.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(10)
    threading.Timer(0.3, release.set).start()
    with caplog.at_level("WARNING"), locked(tmp_path, "build of the CPU kernels"):
        pass
    thread.join(10)
    assert f"waiting for another process's build of the CPU kernels in {tmp_path}" in caplog.text
    with caplog.at_level("WARNING"), locked(tmp_path, "build of the CPU kernels"):  # nobody holds it: no word
        pass
    assert caplog.text.count("waiting for another") == 1


def test_kernels_unavailable_are_said_as_the_machines_lack_not_the_models(monkeypatch, caplog):
    """Without a compiler the log said "the target engine does not serve LlamaForCausalLM", which
    read as a model this project cannot run (an audit): it names the kernels, as a warning."""
    import torch

    from target_node.engine import engine

    def no_kernels(*args, **kwargs):
        raise build.KernelsUnavailable("no C++ compiler (g++) on PATH")

    monkeypatch.setattr(engine, "Engine", no_kernels)
    with caplog.at_level("INFO"):
        assert engine.engine_for(torch.nn.Linear(2, 2)) is None
    (record,) = [r for r in caplog.records if "transformers path" in r.getMessage()]
    assert record.levelname == "WARNING" and "CPU kernels are unavailable (no C++ compiler" in record.getMessage()
    assert "does not serve" not in record.getMessage()


def test_kernels_built_for_another_march_are_keyed_by_it_and_the_cpu_is_taken_for_one_with_its_features(
    tmp_path, monkeypatch
):
    """DFLASH_MARCH=x86-64-v3 builds the AVX2 path on a machine with AVX-512 (for CI), and the Python
    side then takes the CPU for an AVX2 one: /proc's avx512_bf16 made it choose bf16 matmuls the build
    computes without native bf16 (an audit)."""
    script = tmp_path / "bin" / "g++"
    script.parent.mkdir()
    # What g++ -Q --help=target says: AVX512-BF16 under -march=native only.
    script.write_text(
        '#!/bin/sh\necho "$@" >> "$(dirname "$0")/calls"\n'
        'case "$1" in -march=native) bf16=enabled;; *) bf16=disabled;; esac\n'
        'printf "  -march=  %s\\n  -mavx2  [enabled]\\n  -mavx512bf16  [$bf16]\\n" "${1#-march=}"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(script))
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu avx2 avx512f avx512_bf16\n")
    monkeypatch.setattr(build, "CPUINFO", cpuinfo)
    build._native_target.cache_clear()
    try:
        monkeypatch.delenv(build.MARCH_ENV, raising=False)
        assert build.march() == "native" and "-march=native" in build.flags() and build.native_bf16()
        native_key = build.cpu_flags()
        monkeypatch.setenv(build.MARCH_ENV, "x86-64-v3")
        assert "-march=x86-64-v3" in build.flags() and "-march=native" not in build.flags()
        assert build.cpu_flags() != native_key and "x86-64-v3" in build.cpu_flags().split()
        assert not build.native_bf16() and "-mavx2" in build.cpu_flags().split()
        assert "-march=x86-64-v3" in (script.parent / "calls").read_text()
    finally:
        build._native_target.cache_clear()
