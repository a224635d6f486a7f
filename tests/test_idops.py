"""kvxfer.idops: the native control-path helpers and their numpy fallback behave alike.

Every case runs through both implementations; where a C++ compiler is present the native one
must load (a silent fallback to numpy would cost ~1.3x the host time per request).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvxfer import idops
from kvxfer.backends import cpu_build

HAS_CXX = cpu_build.find_compiler() is not None


def _native() -> dict:
    if not idops.ensure():
        if HAS_CXX:
            pytest.fail(f"a C++ compiler is here but the native helpers did not load: {idops.status()}")
        pytest.skip(f"no C++ compiler: {idops.status()}")
    return idops._native_functions(idops._state["native"])


@pytest.fixture(params=["native", "numpy"])
def impl(request) -> dict:
    return _native() if request.param == "native" else idops.NUMPY


def test_native_is_what_the_engine_uses_when_a_compiler_exists():
    if not HAS_CXX:
        pytest.skip("no C++ compiler")
    assert idops.ensure() and idops.status().startswith("native: ")
    assert idops.hold is idops._state["native"].hold


# ------------------------------------------------------------------------ ids_from_list
@pytest.mark.parametrize("kind", [list, tuple])
def test_ids_from_list_converts_the_first_need_ids(impl, kind):
    ids = kind([7, 0, 3, 9, 1, 5])
    a = impl["ids_from_list"](ids, 4, 10)
    assert a.dtype == np.int64 and a.flags.writeable and a.tolist() == [7, 0, 3, 9]
    assert impl["ids_from_list"](ids, 0, 10).size == 0
    a[0] = 2  # a new array, not a view of anything the caller holds
    assert ids[0] == 7


def test_ids_from_list_takes_what_python_takes_as_an_int_but_a_bool(impl):
    assert impl["ids_from_list"]([np.int64(4), np.int32(2), 1, 0], 4, 5).tolist() == [4, 2, 1, 0]


@pytest.mark.parametrize(
    "ids, need, why",
    [
        ([0, 1, 10], 3, "out of range"),
        ([0, -1, 2], 3, "out of range"),
        ([0, 2**64, 2], 3, "out of range"),
        ([0, 2**63, 2], 3, "out of range"),
        ([0, 1.0, 2], 3, "must hold ints"),
        ([0, "1", 2], 3, "must hold ints"),
        ([0, None, 2], 3, "must hold ints"),
        ([0, True, 2], 3, "bool"),
        ([False, 4, 2], 3, "bool"),
        ([0, 1], 3, "needed"),
    ],
)
def test_ids_from_list_refuses_bad_ids_naming_the_field(impl, ids, need, why):
    with pytest.raises(ValueError, match="block_ids") as e:
        impl["ids_from_list"](ids, need, 10)
    assert why in str(e.value)


def test_ids_from_list_refuses_what_is_not_a_list(impl):
    for bad in (np.arange(3), range(3), "012", {0, 1, 2}):
        with pytest.raises(ValueError, match="block_ids: must be a list or tuple"):
            impl["ids_from_list"](bad, 3, 10)


@pytest.mark.parametrize("n", [2, 3, 17, 256, 1000])
def test_ids_from_list_unique_finds_any_repeat(impl, n):
    rng = np.random.default_rng(n)
    ids = rng.permutation(10 * n)[:n].tolist()
    assert impl["ids_from_list"](ids, n, 10 * n, True).tolist() == ids
    for i, j in ((0, n - 1), (n // 2, n // 2 - 1), (1, n - 1)):
        dup = list(ids)
        dup[j] = dup[i]
        if i != j:
            with pytest.raises(ValueError, match="repeated block id"):
                impl["ids_from_list"](dup, n, 10 * n, True)
            assert impl["ids_from_list"](dup, n, 10 * n, False).tolist() == dup
    # a repeat past ``need`` is not looked at
    assert impl["ids_from_list"]([*ids, ids[0]], n, 10 * n, True).tolist() == ids


# ------------------------------------------------------------------------ leases
def _state(nb: int = 64):
    return np.zeros(nb, np.int32), np.arange(nb, dtype=np.int64) * 10  # epochs encode the block


def test_hold_release_bumps_epochs_of_blocks_no_export_holds(impl):
    rc, ep = _state()
    a = np.array([1, 2, 3, 40], np.int64)
    b = np.array([2, 3, 50], np.int64)  # an n>1 sibling sharing 2 and 3
    impl["hold"](rc, a)
    impl["hold"](rc, b)
    assert rc[[1, 2, 3, 40, 50]].tolist() == [1, 2, 2, 1, 1] and rc.sum() == 7
    before = impl["snapshot"](ep, a)
    assert np.frombuffer(before, np.int64).tolist() == [10, 20, 30, 400]
    impl["release"](rc, ep, a)
    assert ep[[1, 2, 3, 40, 50]].tolist() == [11, 20, 30, 401, 500]  # 2, 3 still held by b
    assert not impl["unchanged"](ep, a, before)
    assert impl["unchanged"](ep, b, impl["snapshot"](ep, b))
    impl["release"](rc, ep, b)
    assert rc.sum() == 0 and ep[[2, 3, 50]].tolist() == [21, 31, 501]


def test_a_block_listed_twice_counts_once(impl):
    rc, ep = _state()
    ids = np.array([5, 5, 6], np.int64)
    impl["hold"](rc, ids)
    assert rc[[5, 6]].tolist() == [1, 1]
    impl["release"](rc, ep, ids)
    assert rc.sum() == 0 and ep[[5, 6]].tolist() == [51, 61]


def test_both_implementations_agree_on_random_traffic():
    native, numpy = _native(), idops.NUMPY
    rng = np.random.default_rng(0)
    states = {"native": _state(256), "numpy": _state(256)}
    live: list[np.ndarray] = []
    for step in range(300):
        if live and (rng.random() < 0.45 or len(live) > 20):
            ids = live.pop(int(rng.integers(len(live))))
            for name, f in (("native", native), ("numpy", numpy)):
                f["release"](*states[name], ids)
        else:
            ids = rng.integers(0, 256, int(rng.integers(1, 40))).astype(np.int64)
            live.append(ids)
            for name, f in (("native", native), ("numpy", numpy)):
                f["hold"](states[name][0], ids)
        (rc1, ep1), (rc2, ep2) = states["native"], states["numpy"]
        assert np.array_equal(rc1, rc2) and np.array_equal(ep1, ep2), step
        probe = rng.integers(0, 256, 17).astype(np.int64)
        assert native["snapshot"](ep1, probe) == numpy["snapshot"](ep2, probe)


def test_an_id_past_the_end_writes_nothing(impl):
    rc, ep = _state()
    impl["hold"](rc, np.array([1, 2], np.int64))
    rc0, ep0 = rc.copy(), ep.copy()
    ids = np.array([1, 64], np.int64)
    for name, args in (("hold", (rc, ids)), ("release", (rc, ep, ids)), ("snapshot", (ep, ids))):
        with pytest.raises(IndexError):
            impl[name](*args)
    with pytest.raises(IndexError):
        impl["unchanged"](ep, ids, b"\0" * 16)
    assert np.array_equal(rc, rc0) and np.array_equal(ep, ep0)


# The native module's own argument checks: in C, a bad id or array would write out of bounds.
@pytest.mark.parametrize("bad", [64, -1, 2**40])
def test_native_checks_every_id_before_writing(bad):
    f = _native()
    rc, ep = _state()
    f["hold"](rc, np.array([1, 2], np.int64))
    rc0, ep0 = rc.copy(), ep.copy()
    ids = np.array([1, bad], np.int64)
    for name, args in (("hold", (rc, ids)), ("release", (rc, ep, ids)), ("snapshot", (ep, ids))):
        with pytest.raises(IndexError, match=rf"{name}: block id {bad} \(item 1\) out of range \[0, 64\)"):
            f[name](*args)
    with pytest.raises(IndexError, match="out of range"):
        f["unchanged"](ep, ids, b"\0" * 16)
    assert np.array_equal(rc, rc0) and np.array_equal(ep, ep0)


def test_native_refuses_wrong_arrays():
    f = _native()
    rc, ep = _state()
    ids = np.array([1, 2], np.int64)
    with pytest.raises(TypeError, match="ids"):
        f["hold"](rc, ids.astype(np.int32))
    with pytest.raises(TypeError, match="ids"):
        f["hold"](rc, np.arange(8, dtype=np.int64)[::2])  # not contiguous
    with pytest.raises(TypeError, match="refcount"):
        f["hold"](rc.astype(np.int64), ids)
    ro = rc.copy()
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="refcount"):
        f["hold"](ro, ids)
    with pytest.raises(TypeError, match="epochs"):
        f["release"](rc, ep.astype(np.int32), ids)
    with pytest.raises(ValueError, match="epochs has 8 blocks, refcount 64"):
        f["release"](rc, ep[:8].copy(), ids)
    with pytest.raises(TypeError):
        f["max_id"](np.array([1, 2], np.int32))
    assert rc.sum() == 0


def test_unchanged_takes_bytes_or_arrays_and_a_short_snapshot_is_a_change(impl):
    _, ep = _state()
    ids = np.array([3, 9, 1], np.int64)
    snap = impl["snapshot"](ep, ids)
    assert impl["unchanged"](ep, ids, snap)
    assert impl["unchanged"](ep, ids, np.frombuffer(snap, np.int64))
    assert not impl["unchanged"](ep, ids, snap[:16])
    assert impl["unchanged"](ep, ids[:0], b"")


def test_max_id_reads_unsigned(impl):
    assert impl["max_id"](np.array([3, 17, 5], np.uint64)) == 17
    assert impl["max_id"](np.array([3, -1], np.int64)) == 2**64 - 1  # a negative id is huge
    assert impl["max_id"](np.zeros(0, np.uint64)) == 0


def test_numpy_is_used_when_asked_and_says_so():
    code = "from kvxfer import idops; print(idops.ensure(), idops.status())"
    env = {**os.environ, idops.ENV: "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"False {idops.ENV}=0: numpy"


def test_as_uint64_takes_params_ids_unbounded_by_a_cache(impl):
    a = impl["as_uint64"]([0, 5, 2**62])
    assert a.dtype == np.uint64 and a.tolist() == [0, 5, 2**62]
    with pytest.raises(OverflowError):
        impl["as_uint64"]([0, -1])
    with pytest.raises(OverflowError):
        impl["as_uint64"]([0, 2**64])
    with pytest.raises(TypeError):
        impl["as_uint64"]([0, 1.5])


def test_moved_names_the_loads_whose_blocks_were_released(impl):
    rc, ep = _state()
    loads = [np.array(x, np.int64) for x in ([1, 2, 3], [4], [5, 6], [7, 8, 9, 10])]
    for ids in loads:
        impl["hold"](rc, ids)
    snaps = [impl["snapshot"](ep, ids) for ids in loads]
    assert impl["moved"](ep, loads, snaps) == []
    assert impl["moved"](ep, loads[:1], snaps[:1]) == []
    impl["release"](rc, ep, loads[2])
    impl["release"](rc, ep, loads[3])
    assert impl["moved"](ep, loads, snaps) == [2, 3]
    assert impl["moved"](ep, loads[3:], snaps[3:]) == [0]
    as_arrays = [np.frombuffer(s, np.int64) for s in snaps]  # the loader holds them as arrays
    assert impl["moved"](ep, loads, as_arrays) == [2, 3]


def test_moved_with_a_short_snapshot_or_an_id_out_of_range(impl):
    _, ep = _state()
    loads = [np.array([1, 2], np.int64), np.array([3], np.int64)]
    snaps = [impl["snapshot"](ep, ids) for ids in loads]
    assert impl["moved"](ep, loads, [snaps[0][:8], snaps[1]]) == [0]  # a short snapshot: a change
    with pytest.raises(IndexError):
        impl["moved"](ep, [loads[0], np.array([64], np.int64)], snaps)


def test_native_moved_checks_its_arguments_before_comparing():
    f = _native()
    _, ep = _state()
    ids = [np.array([1, 2], np.int64)]
    with pytest.raises(TypeError, match="must be lists"):
        f["moved"](ep, tuple(ids), [b"\0" * 16])
    with pytest.raises(ValueError, match="1 id arrays, 2 snapshots"):
        f["moved"](ep, ids, [b"\0" * 16, b""])
    with pytest.raises(TypeError, match="ids"):
        f["moved"](ep, [ids[0].astype(np.int32)], [b"\0" * 16])
    with pytest.raises(IndexError, match=r"moved: block id 99 \(item 1\) out of range \[0, 64\)"):
        f["moved"](ep, [np.array([1, 2], np.int64), np.array([0, 99], np.int64)], [b"\0" * 16] * 2)


@pytest.mark.parametrize("kind", [list, tuple])
def test_any_repeat_reads_the_arrays_as_one_list(impl, kind):
    a, b, c = (np.array(x, np.int64) for x in ([5, 1, 9], [2, 7], [40, 3]))
    assert not impl["any_repeat"](kind([a, b, c]))
    assert not impl["any_repeat"](kind([a])) and not impl["any_repeat"](kind([]))
    assert impl["any_repeat"](kind([a, b, np.array([8, 9], np.int64)]))  # 9 in the first and the last
    assert impl["any_repeat"](kind([np.array([4, 4], np.int64)]))  # within one array
    assert not impl["any_repeat"](kind([a[:0], b]))
    rng = np.random.default_rng(0)
    for _ in range(50):
        parts = [
            rng.integers(0, 3000, size=int(rng.integers(0, 300))) for _ in range(int(rng.integers(1, 9)))
        ]
        want = len(np.unique(np.concatenate(parts))) != sum(p.size for p in parts)
        assert impl["any_repeat"](kind(parts)) == want


def test_any_repeat_refuses_negative_ids(impl):
    with pytest.raises(ValueError, match="negative block id -3"):
        impl["any_repeat"]([np.array([1, 2], np.int64), np.array([-3], np.int64)])


def test_native_any_repeat_refuses_what_is_not_int64_arrays():
    f = _native()
    with pytest.raises(TypeError, match="list or tuple"):
        f["any_repeat"](np.array([1, 2], np.int64))
    with pytest.raises(TypeError, match="ids"):
        f["any_repeat"]([np.array([1, 2], np.int32)])
    with pytest.raises(TypeError, match="ids"):
        f["any_repeat"]([np.arange(8, dtype=np.int64)[::2]])


def test_a_list_changed_by_an_items_index_is_read_safely():
    """An item's ``__index__`` is Python code that may shrink the list being read: the native
    loop must neither read freed memory nor past the end."""
    f = _native()
    ids: list = []

    class Shrinks:
        def __index__(self) -> int:
            ids.clear()
            return 1

    ids.extend([0, Shrinks(), 2, 3])
    with pytest.raises(ValueError, match="changed while it was read"):
        f["ids_from_list"](ids, 4, 10)

    class Grows:
        def __index__(self) -> int:
            ids2.extend(range(100))  # may move the list's storage
            return 1

    ids2: list = [0, Grows(), 2, 3]
    assert f["ids_from_list"](ids2, 4, 10).tolist() == [0, 1, 2, 3]


# --------------------------------------------------------------------------- exact_ints
@pytest.mark.parametrize("kind", [list, tuple])
def test_exact_ints_accepts_plain_ints_only(impl, kind):
    assert impl["exact_ints"](kind([0, 5, 2**40])) and impl["exact_ints"](kind([]))
    for odd in (True, np.int64(3), 3.0, "3", None):  # a bool, a numpy int, anything else
        assert not impl["exact_ints"](kind([1, odd, 2])), odd

    class Sub(int):
        pass

    assert not impl["exact_ints"](kind([Sub(1)]))


def test_exact_ints_refuses_what_is_not_a_list(impl):
    with pytest.raises(TypeError, match="list or tuple"):
        impl["exact_ints"](np.arange(3))


# ------------------------------------------------------------- id sets: bitmap and hash
@pytest.mark.parametrize(
    "bound",
    [
        300,  # a bitmap cleared whole (a few words)
        900_000,  # a bitmap cleared word by word (far more words than ids)
        3 << 40,  # a hash set (beyond any bitmap)
    ],
)
def test_repeat_checks_are_exact_and_forget_between_calls(impl, bound):
    """The native sets (a kept bitmap, or a hash set when ids are far apart): a repeat anywhere
    is found, none is invented, and nothing is remembered from one call to the next (the same
    ids again, or in another call, are not repeats)."""
    rng = np.random.default_rng(bound)
    ids = rng.choice(min(bound - 1, 1 << 40), size=200, replace=False).astype(np.int64)
    ids[-1] = bound - 1  # the top of the range (not drawn above: no repeat)
    for _ in range(2):  # a second time: the first call's bits are gone
        assert not impl["any_repeat"]([ids[:100], ids[100:]])
    rep = ids.copy()
    rep[150] = rep[3]
    assert impl["any_repeat"]([rep[:100], rep[100:]])
    assert not impl["any_repeat"]([ids[100:]])  # after a call that found a repeat midway
    if bound <= 1 << 40:
        as_list = ids.tolist()
        assert impl["ids_from_list"](as_list, 200, bound, True).tolist() == as_list
        with pytest.raises(ValueError, match="repeated block id"):
            impl["ids_from_list"](rep.tolist(), 200, bound, True)
        assert impl["ids_from_list"](as_list, 200, bound, True).tolist() == as_list


def test_hold_release_count_a_block_once_with_a_hash_set(impl):
    """A refcount array past the bitmap's size (the native hash set): a block listed twice
    still counts once, and releasing bumps the epoch of blocks no export holds."""
    n = (1 << 21) + 5
    rc, ep = np.zeros(n, np.int32), np.zeros(n, np.int64)
    a = np.array([n - 1, 7, n - 1, 123_456], np.int64)
    impl["hold"](rc, a)
    impl["hold"](rc, a[:2])
    assert rc[[n - 1, 7, 123_456]].tolist() == [2, 2, 1]
    impl["release"](rc, ep, a)
    assert rc[[n - 1, 7, 123_456]].tolist() == [1, 1, 0] and ep[[n - 1, 7, 123_456]].tolist() == [0, 0, 1]


def test_ids_from_list_reads_every_int_size_and_sign_alike(impl):
    """The native fast path for plain ints of one internal digit (|v| < 2**30) and the general
    conversion agree at the digit boundaries, for both signs, and with numpy ints mixed in; a
    bool among them is refused (it is an int to Python, never a block id)."""
    vals = [0, 1, 2**30 - 1, 2**30, 2**30 + 1, 2**31, 2**40 + 3, np.int64(5)]
    out = impl["ids_from_list"](vals, len(vals), 2**62)
    assert out.tolist() == [0, 1, 2**30 - 1, 2**30, 2**30 + 1, 2**31, 2**40 + 3, 5]
    with pytest.raises(ValueError, match="bool"):
        impl["ids_from_list"]([*vals, True], len(vals) + 1, 2**62)
    for neg in (-1, -(2**30) + 1, -(2**30), -(2**31)):
        with pytest.raises(ValueError, match="out of range"):
            impl["ids_from_list"]([3, neg], 2, 10)
    assert impl["as_uint64"]([7, 2**30 - 1, 2**30]).tolist() == [7, 2**30 - 1, 2**30]


def test_the_library_name_covers_every_header_the_source_includes():
    """The native module is one translation unit, kvx_ctl.cpp with the local headers it includes
    (recursively): every one is in ``CONTROL_MODULE.headers``, so that the library's name (the
    hash of the source, the headers and the flags) changes with any of them and a library built
    from older sources is never loaded."""
    import re
    from pathlib import Path

    target = cpu_build.CONTROL_MODULE
    csrc = Path(cpu_build.source_dir(target))
    found: set[Path] = set()
    todo = [target.source]
    while todo:
        src = Path(todo.pop())
        for name in re.findall(r'^#include "([^"]+)"', (csrc / src).read_text(), re.M):
            header = Path(os.path.normpath(src.parent / name))
            if header not in found:
                found.add(header)
                todo.append(header)
    assert found == set(target.headers)


@pytest.mark.parametrize("version", ["3.10", "3.12", "3.13"])
def test_native_helpers_build_and_agree_on_other_pythons(tmp_path, version):
    """The fast int read differs by CPython version (3.12 moved the int layout: the unstable
    API reads it there; 3.10 takes the general path): the module compiles against each version
    installed here and converts ids alike (the GPU host runs 3.12)."""
    import glob
    import shutil

    found = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}*/bin/python{version}")))
    exe = found[-1] if found else shutil.which(f"python{version}")  # (pyenv's shims need a selection)
    if exe is None or not HAS_CXX:
        pytest.skip(f"no python{version} (or no C++ compiler) on this machine")
    inc = subprocess.run(
        [exe, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if not os.path.exists(os.path.join(inc, "Python.h")):
        pytest.skip(f"python{version} has no headers here")
    so = tmp_path / "_kvx_ctl.so"
    target = cpu_build.CONTROL_MODULE
    flags = [f for f in target.flags if not f.startswith("-I")]
    src = os.path.join(cpu_build.source_dir(target), target.source)
    subprocess.run(["g++", *flags, f"-I{inc}", "-o", str(so), src], check=True, capture_output=True)
    check = (
        "import importlib.util, array, sys\n"
        f"s = importlib.util.spec_from_file_location('_kvx_ctl', {str(so)!r})\n"
        "m = importlib.util.module_from_spec(s); s.loader.exec_module(m)\n"
        "ids = [0, 1, 7, 2**30 - 1, 2**30, 2**31 + 5, 2**40]\n"
        "got = list(array.array('q', bytes(m.ids_from_seq(ids, len(ids), 2**62, False))))\n"
        "assert got == [0, 1, 7, 2**30 - 1, 2**30, 2**31 + 5, 2**40], got\n"
        "for bad in ([-1], [-(2**31)], [True]):\n"
        "    try:\n"
        "        m.ids_from_seq(bad, 1, 10, False)\n"
        "    except (ValueError, TypeError):\n"
        "        continue\n"
        "    sys.exit(f'accepted {bad}')\n"
    )
    res = subprocess.run([exe, "-c", check], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
