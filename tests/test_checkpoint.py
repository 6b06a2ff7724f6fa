"""Issue 13 items 2, 3, 4, 5, 9: checkpoints never lose or replace what they do not own, are
atomic against a kill at every step of the save protocol, are checked against their
description, and merged models refuse a load and say why they cannot train."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from kfused.integration import (AdapterConfig, CheckpointError, adapter_modules,
                                adapter_state_dict, get_state,
                                inject, load, merge, merged_modules, read_checkpoint_config, save,
                                unmerge)
from kfused.integration import checkpoint as ck

from _hf_helpers import batch, make

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------
# helpers: a tiny plain-torch model (cheap to build in a subprocess) and checkpoint surgery


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def tiny(fill=None, method="lora"):
    torch.manual_seed(0)
    m = Tiny()
    inject(m, AdapterConfig(method=method, targets=["fc1", "fc2"], init="random",
                            backend="reference"))
    if fill is not None:
        with torch.no_grad():
            for i, n in enumerate(get_state(m).param_names):
                m.get_parameter(n).fill_(fill + i)
    return m


def states_equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def loaded(directory):
    torch.manual_seed(0)
    fresh = Tiny()
    load(fresh, str(directory))
    return adapter_state_dict(fresh)


def version_folder(d):
    ptr = json.loads((d / ck.POINTER).read_text())
    return d / ptr["version"]


def rewrite(d, tensors=None, meta=None, config_bytes=None):
    """Replace the weights / description of checkpoint ``d`` and recompute the pointer's hashes,
    as a hostile or buggy writer would (the hashes alone then prove nothing)."""
    from safetensors.torch import save as save_bytes

    folder = version_folder(d)
    if tensors is not None:
        (folder / ck.WEIGHTS).write_bytes(save_bytes(tensors))
    if meta is not None:
        config_bytes = json.dumps(meta).encode()
    if config_bytes is not None:
        (folder / ck.CONFIG).write_bytes(config_bytes)
    ptr = json.loads((d / ck.POINTER).read_text())
    ptr["sha256"] = {n: hashlib.sha256((folder / n).read_bytes()).hexdigest()
                     for n in (ck.WEIGHTS, ck.CONFIG)}
    (d / ck.POINTER).write_text(json.dumps(ptr))


def write_v1(d, model):
    """A format-1 checkpoint (files directly in d + COMPLETE), as kfused 0.1 wrote it."""
    from safetensors.torch import save as save_bytes

    tmp = d.parent / "_v2"
    save(model, str(tmp))
    meta = json.loads((version_folder(tmp) / ck.CONFIG).read_text())
    meta["format_version"] = 1
    d.mkdir(exist_ok=True)
    (d / ck.WEIGHTS).write_bytes(save_bytes(adapter_state_dict(model)))
    (d / ck.CONFIG).write_text(json.dumps(meta))
    (d / ck.MARKER).write_text(json.dumps({n: hashlib.sha256((d / n).read_bytes()).hexdigest()
                                           for n in (ck.WEIGHTS, ck.CONFIG)}))
    shutil.rmtree(tmp)


# ------------------------------------------------------------------------------------------
# layout and round trip


def test_round_trip_and_layout(tmp_path):
    m = tiny(fill=1.0)
    d = tmp_path / "c"
    assert save(m, str(d)) == str(d)
    names = sorted(os.listdir(d))
    assert len(names) == 2 and names[1] == ck.POINTER and names[0].startswith(ck.VERSION_PREFIX)
    assert sorted(os.listdir(d / names[0])) == sorted([ck.WEIGHTS, ck.CONFIG])
    meta = read_checkpoint_config(str(d))
    assert meta["format_version"] == ck.FORMAT_VERSION and meta["config"]["method"] == "lora"
    assert all("shape" in v and "dtype" in v for v in meta["tensors"].values())
    assert states_equal(loaded(d), adapter_state_dict(m))
    save(tiny(fill=5.0), str(d))  # a second save replaces the version, leaves no other folder
    assert len(os.listdir(d)) == 2
    assert states_equal(loaded(d), adapter_state_dict(tiny(fill=5.0)))
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_adapter_dtype_given_as_torch_dtype_saves_and_loads(tmp_path):
    """AdapterConfig(adapter_dtype=torch.float64) (as kfused.from_peft(..., adapter_dtype=...)
    passes it on) is recorded by name: save wrote no checkpoint (the config is JSON), and the
    loaded adapters have that dtype."""
    torch.manual_seed(0)
    m = inject(Tiny(), AdapterConfig(method="lora", targets=["fc1", "fc2"], init="random",
                                     backend="reference", adapter_dtype=torch.float64))
    save(m, str(tmp_path / "c"))
    assert get_state(m).config.adapter_dtype == "float64"
    assert read_checkpoint_config(str(tmp_path / "c"))["config"]["adapter_dtype"] == "float64"
    got = loaded(tmp_path / "c")
    assert states_equal(got, adapter_state_dict(m))
    assert {t.dtype for t in got.values()} == {torch.float64}
    with pytest.raises(TypeError, match="adapter_dtype"):
        AdapterConfig(adapter_dtype=16)


# ------------------------------------------------------------------------------------------
# item 3: save never deletes or replaces what it did not write


def test_foreign_files_are_kept(tmp_path):
    d = tmp_path / "peft_dir"
    d.mkdir()
    foreign = {"adapter_config.json": '{"peft_type": "LORA"}', "adapter_model.safetensors": "x",
               "README.md": "# my model", "notes/todo.txt": "keep me"}
    for name, text in foreign.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    save(tiny(fill=1.0), str(d))
    save(tiny(fill=2.0), str(d))  # re-saving into our own checkpoint keeps them too
    for name, text in foreign.items():
        assert (d / name).read_text() == text, name
    assert states_equal(loaded(d), adapter_state_dict(tiny(fill=2.0)))
    # a foreign file next to our version folder survives the cleanup of leftovers as well
    (d / (ck.VERSION_PREFIX + "mine")).mkdir()
    save(tiny(fill=3.0), str(d))
    assert (d / (ck.VERSION_PREFIX + "mine")).is_dir()


def test_refuses_a_file(tmp_path):
    f = tmp_path / "important.txt"
    f.write_text("precious")
    with pytest.raises(CheckpointError, match=r"important\.txt: it exists and is a regular file"):
        save(tiny(), str(f))
    assert f.read_text() == "precious"
    link = tmp_path / "link"
    link.symlink_to(f)
    with pytest.raises(CheckpointError, match="is a regular file"):
        save(tiny(), str(link))
    assert f.read_text() == "precious" and link.is_symlink()
    with pytest.raises(CheckpointError, match="is not a directory"):
        load(Tiny(), str(f))


def test_refuses_a_foreign_pointer(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    (d / ck.POINTER).write_text('{"something": "else"}')
    with pytest.raises(CheckpointError, match=f"{ck.POINTER} there was not written by kfused"):
        save(tiny(), str(d))
    assert (d / ck.POINTER).read_text() == '{"something": "else"}'
    assert os.listdir(d) == [ck.POINTER]


# ------------------------------------------------------------------------------------------
# item 4: atomic saves; leftovers of killed saves are cleaned


def test_interrupted_save_keeps_old_version(tmp_path, monkeypatch):
    d = tmp_path / "c"
    save(tiny(fill=1.0), str(d))
    (d / "user.txt").write_text("u")
    before = sorted(os.listdir(d))

    def killed(path, data, step=None):  # dies half way through writing the weights
        with open(path, "xb") as f:
            f.write(data[:10])
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(ck, "_fsync_write", killed)
    with pytest.raises(KeyboardInterrupt):
        save(tiny(fill=2.0), str(d))
    monkeypatch.undo()
    assert sorted(os.listdir(d)) == before  # the half-written version was removed
    assert states_equal(loaded(d), adapter_state_dict(tiny(fill=1.0)))


CHILD = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_checkpoint import tiny
    from kfused.integration import save
    save(tiny(fill=float(sys.argv[2])), sys.argv[1])
""")


def _killed_save(d, fill, point):
    env = dict(os.environ, **{ck.KILL_ENV: point, "PYTHONPATH": REPO})
    code = CHILD.format(tests=os.path.join(REPO, "tests"))
    r = subprocess.run([sys.executable, "-c", code, str(d), str(fill)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == ck.KILL_EXIT, (point, r.returncode, r.stderr[-2000:])


def _clean_listing(d, extra=()):
    names = sorted(os.listdir(d))
    versions = [n for n in names if n.startswith(ck.VERSION_PREFIX)]
    assert names == sorted([ck.POINTER, *versions, *extra]) and len(versions) == 1, names


def test_a_load_beside_a_running_save_never_removes_what_it_committed(tmp_path, monkeypatch):
    """A load's cleaning read the pointer (version A); a save in another thread committed B
    and removed A; the cleaning then took B, named by no pointer it had read and written by
    no save still active, for a leftover and removed it: the checkpoint held no version.
    Now a save holds a lock on the folder and a load cleans only when it can take it."""
    import threading

    d = tmp_path / "c"
    save(tiny(1.0), str(d))
    orig, main = ck._read_pointer, threading.current_thread()
    saved, armed, threads = threading.Event(), [True], []

    def racing_save():
        save(tiny(2.0), str(d))
        saved.set()

    def hooked(directory):
        ptr = orig(directory)
        if armed[0] and threading.current_thread() is main:
            armed[0] = False       # inside the load's cleaning: a save runs now, elsewhere
            threads.append(threading.Thread(target=racing_save))
            threads[0].start()
            saved.wait(timeout=3)  # before: it committed meanwhile; now it waits for the lock
        return ptr

    monkeypatch.setattr(ck, "_read_pointer", hooked)
    load(tiny(), str(d))
    threads[0].join(timeout=120)
    monkeypatch.undo()
    assert saved.is_set()
    assert states_equal(loaded(d), adapter_state_dict(tiny(2.0)))


def test_kill_at_every_step_of_save(tmp_path):
    """A process killed after (or half way through) every step of the save protocol: load
    gives the old version up to the commit (step 6) and the new one from it on, never an
    error or a mix; the next load, or the next save, removes every leftover."""
    old, new = tiny(fill=1.0), tiny(fill=2.0)
    old_state, new_state = adapter_state_dict(old), adapter_state_dict(new)
    assert len(ck.KILL_POINTS) == ck.SAVE_STEPS + 3
    for point in ck.KILL_POINTS:
        d = tmp_path / f"c{point}"
        save(old, str(d))
        (d / "adapter_config.json").write_text("{}")  # a foreign file with a PEFT name
        _killed_save(d, 2.0, point)
        committed = int(point.rstrip("-")) >= 6
        assert os.path.exists(d / ck.POINTER), point
        twin = tmp_path / f"twin{point}"
        shutil.copytree(d, twin, symlinks=True)
        got = loaded(d)  # loading cleans ...
        assert states_equal(got, new_state if committed else old_state), point
        _clean_listing(d, ["adapter_config.json"])
        save(tiny(fill=3.0), str(twin))  # ... and so does saving
        _clean_listing(twin, ["adapter_config.json"])
        assert states_equal(loaded(twin), adapter_state_dict(tiny(fill=3.0)))
        assert (d / "adapter_config.json").read_text() == "{}"


@pytest.mark.parametrize("point", ["2", "5", "6"])
def test_kill_during_first_save(tmp_path, point):
    d = tmp_path / "c"
    _killed_save(d, 2.0, point)
    if int(point) < 6:  # there never was a complete version: a clear error, never a partial load
        with pytest.raises(CheckpointError, match="holds no kfused checkpoint"):
            loaded(d)
        save(tiny(fill=4.0), str(d))
        _clean_listing(d)
        assert states_equal(loaded(d), adapter_state_dict(tiny(fill=4.0)))
    else:
        assert states_equal(loaded(d), adapter_state_dict(tiny(fill=2.0)))
        _clean_listing(d)


def test_live_writer_leftovers_are_kept(tmp_path):
    """The version folder and pointer temp file of a save still running (this pid, in
    progress; or another live process) are not cleaned; once their writer is gone they are."""
    d = tmp_path / "c"
    save(tiny(fill=1.0), str(d))
    ident = ck._new_id()
    folder, tmp = d / (ck.VERSION_PREFIX + ident), d / f".{ck.POINTER}.{ident}.tmp"
    folder.mkdir()
    tmp.write_text("{}")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        other = ident.replace(f"-{os.getpid()}-", f"-{live.pid}-")
        other_folder = d / (ck.VERSION_PREFIX + other)
        other_folder.mkdir()
        with ck._ACTIVE_LOCK:
            ck._ACTIVE.add(ident)
        try:
            loaded(d)
            assert folder.is_dir() and tmp.is_file() and other_folder.is_dir()
        finally:
            with ck._ACTIVE_LOCK:
                ck._ACTIVE.discard(ident)
        loaded(d)
        assert not folder.exists() and not tmp.exists() and other_folder.is_dir()
    finally:
        live.kill()
        live.wait()
    loaded(d)
    assert not other_folder.exists()
    _clean_listing(d)


def test_format1_checkpoints_load_and_upgrade(tmp_path):
    d = tmp_path / "c"
    write_v1(d, tiny(fill=1.0))
    (d / "README.md").write_text("mine")
    assert states_equal(loaded(d), adapter_state_dict(tiny(fill=1.0)))
    save(tiny(fill=2.0), str(d))  # the v1 files (verified ours by their hashes) are superseded
    assert sorted(n for n in os.listdir(d) if not n.startswith(ck.VERSION_PREFIX)) == \
        sorted([ck.POINTER, "README.md"])
    assert states_equal(loaded(d), adapter_state_dict(tiny(fill=2.0)))


def test_format1_killed_rename_is_recovered(tmp_path):
    """kfused 0.1 moved the old folder to .<name>.tmp-<pid>-<hex>.old before renaming the new
    one in; killed in between, the path was missing. The next load puts it back."""
    moved = tmp_path / ".c.tmp-99999999-0123abcd.old"
    write_v1(moved, tiny(fill=1.0))
    partial = tmp_path / ".c.tmp-99999999-0123abcd"
    partial.mkdir()
    (partial / ck.WEIGHTS).write_bytes(b"\0" * 8)
    assert states_equal(loaded(tmp_path / "c"), adapter_state_dict(tiny(fill=1.0)))
    assert sorted(os.listdir(tmp_path)) == ["c"]


# ------------------------------------------------------------------------------------------
# item 5: the weights file is checked against its description


def _one_tensor(d):
    from safetensors.torch import load as load_bytes

    tensors = load_bytes((version_folder(d) / ck.WEIGHTS).read_bytes())
    name = next(n for n, t in tensors.items() if t.dim() == 2 and t.shape[0] > 1)
    return tensors, name


def test_shape_disagreeing_with_description(tmp_path):
    d = tmp_path / "c"
    save(tiny(fill=1.0), str(d))
    tensors, name = _one_tensor(d)
    want = tuple(tensors[name].shape)
    tensors[name] = tensors[name][:1].clone()  # would broadcast on copy_
    rewrite(d, tensors=tensors)
    with pytest.raises(CheckpointError, match=rf"{ck.WEIGHTS}: tensor '{name}' has shape "
                                              rf"\(1, {want[1]}\) but {ck.CONFIG} says"):
        loaded(d)
    # description edited to agree: the model's shape is then the one that disagrees
    meta = json.loads((version_folder(d) / ck.CONFIG).read_text())
    meta["tensors"][name]["shape"] = [1, want[1]]
    rewrite(d, meta=meta)
    with pytest.raises(CheckpointError, match=rf"shape mismatch.*{name}"):
        loaded(d)


def test_dtype_disagreeing_with_description(tmp_path):
    d = tmp_path / "c"
    save(tiny(fill=1.0), str(d))
    tensors, name = _one_tensor(d)
    tensors[name] = tensors[name].long()
    rewrite(d, tensors=tensors)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has dtype int64 but "
                                              rf"{ck.CONFIG} says float32"):
        loaded(d)
    meta = json.loads((version_folder(d) / ck.CONFIG).read_text())
    meta["tensors"][name]["dtype"] = "int64"
    rewrite(d, meta=meta)
    with pytest.raises(CheckpointError, match=rf"dtype mismatch.*{name}: checkpoint int64, "
                                              "model float32"):
        loaded(d)


def test_missing_and_extra_tensors(tmp_path):
    d = tmp_path / "c"
    save(tiny(fill=1.0), str(d))
    tensors, name = _one_tensor(d)
    rest = {n: t for n, t in tensors.items() if n != name}
    rewrite(d, tensors=rest)
    with pytest.raises(CheckpointError, match=rf"{ck.WEIGHTS}: tensor '{name}' is described "
                                              "in .* but missing from the weights file"):
        loaded(d)
    rewrite(d, tensors={**tensors, "stowaway": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="tensor 'stowaway' is in the weights file but not "
                                              "described"):
        loaded(d)


def test_untouched_model_after_refused_load(tmp_path):
    """Every file check happens before any adapter tensor of the model is written."""
    d = tmp_path / "c"
    save(tiny(fill=1.0), str(d))
    tensors, name = _one_tensor(d)
    tensors[name] = tensors[name].long()
    rewrite(d, tensors=tensors)
    m = tiny(fill=7.0)
    before = adapter_state_dict(m)
    with pytest.raises(CheckpointError):
        load(m, str(d))
    assert states_equal(adapter_state_dict(m), before)


@pytest.mark.parametrize("content,match", [
    (b"{not json", "cannot read the checkpoint pointer"),
    (b"[1, 2]", "pointer is not a JSON object"),
    (b'{"format": "kfused-adapter", "format_version": 2, "version": "../../etc", "sha256": {}}',
     "invalid version name"),
    (b'{"format": "kfused-adapter", "format_version": "2"}', "invalid format_version"),
    (b"\xff\xfe", "cannot read the checkpoint pointer"),
])
def test_invalid_pointer(tmp_path, content, match):
    d = tmp_path / "c"
    save(tiny(), str(d))
    (d / ck.POINTER).write_bytes(content)
    with pytest.raises(CheckpointError, match=f"{ck.POINTER}.*{match}|{match}"):
        loaded(d)


@pytest.mark.parametrize("content,match", [
    (b"{not json", "cannot read the COMPLETE marker"),
    (b"[]", "COMPLETE marker is not a JSON object"),
    (b'{"adapter_model.safetensors": 1}', "must map"),
])
def test_invalid_v1_marker(tmp_path, content, match):
    d = tmp_path / "c"
    write_v1(d, tiny())
    (d / ck.MARKER).write_bytes(content)
    with pytest.raises(CheckpointError, match=match):
        loaded(d)


def test_invalid_description(tmp_path):
    d = tmp_path / "c"
    save(tiny(), str(d))
    rewrite(d, config_bytes=b"{oops")
    with pytest.raises(CheckpointError, match=rf"{ck.CONFIG}: invalid JSON"):
        loaded(d)
    rewrite(d, meta={"format": "kfused-adapter", "format_version": 2, "config": {},
                     "base": {}, "tensors": {"a": {"shape": [-1], "dtype": "float32"}}})
    with pytest.raises(CheckpointError, match="tensor 'a' has an invalid shape"):
        loaded(d)
    rewrite(d, meta={"format": "kfused-adapter", "format_version": 2, "base": {},
                     "tensors": {}})
    with pytest.raises(CheckpointError, match="field 'config' is missing"):
        loaded(d)


def test_corrupt_weights_and_missing_folder(tmp_path):
    d = tmp_path / "c"
    save(tiny(), str(d))
    w = version_folder(d) / ck.WEIGHTS
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match the hash"):
        loaded(d)
    (version_folder(d) / ck.WEIGHTS).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad}")
    rewrite(d)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        loaded(d)
    shutil.rmtree(version_folder(d))
    with pytest.raises(CheckpointError, match="is incomplete"):
        loaded(d)
    with pytest.raises(CheckpointError, match="does not exist"):
        loaded(tmp_path / "nowhere")


# ------------------------------------------------------------------------------------------
# item 2: load into a merged model; item 9: training a merged model


def _gpt2(seed_fill=None):
    m = make("gpt2")
    inject(m, AdapterConfig(method="krona", init="random", backend="reference"))
    if seed_fill is not None:
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed_fill)
            for n in get_state(m).param_names:
                p = m.get_parameter(n)
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return m.eval()


def test_load_into_merged_model_is_refused(tmp_path):
    d = tmp_path / "c"
    save(_gpt2(seed_fill=2), str(d))
    inputs = batch("gpt2")
    m, twin = _gpt2(seed_fill=1), _gpt2(seed_fill=1)
    merge(m), merge(twin)
    assert merged_modules(m)
    frozen = {n: p.detach().clone() for n, p in m.named_parameters()}
    with torch.no_grad():
        y_merged = m(**inputs).logits
    with pytest.raises(CheckpointError, match=r"into a merged model.*unmerge\(model\), then load"):
        load(m, str(d))
    for n, p in m.named_parameters():  # nothing changed: frozen and adapter weights identical
        assert torch.equal(p, frozen[n]), n
    with torch.no_grad():
        assert torch.equal(m(**inputs).logits, y_merged)
    unmerge(m), unmerge(twin)  # unmerge restores exactly what it would have without the attempt
    for (n, p), (_, q) in zip(m.named_parameters(), twin.named_parameters()):
        assert torch.equal(p, q), n
    load(m, str(d))  # the documented path: unmerge, load, merge
    load(twin, str(d))
    ref = make("gpt2").eval()  # a base that was never merged, + the loaded adapters
    load(ref, str(d))
    with torch.no_grad():
        y_loaded = m(**inputs).logits
        assert torch.equal(y_loaded, twin(**inputs).logits)
        # merge/unmerge round the frozen weights by an add/sub pair, nothing more
        for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=n)
        torch.testing.assert_close(y_loaded, ref(**inputs).logits, rtol=1e-5, atol=1e-5)
        merge(m)
        torch.testing.assert_close(m(**inputs).logits, y_loaded, rtol=1e-4, atol=1e-4)


def test_training_a_merged_model_says_so():
    m = _gpt2(seed_fill=1)
    merge(m)
    inputs = batch("gpt2")
    with torch.no_grad():  # inference in any mode still works
        m.train()
        m(**inputs)
    m.eval()
    m(**inputs)  # eval mode with grad enabled: no guard (e.g. input attributions)
    m.train()
    loss = m(**inputs).loss
    with pytest.raises(RuntimeError, match=r"this model is merged.*unmerge\(model\) before "
                                           "training"):
        loss.backward()
    unmerge(m)
    assert not merged_modules(m)
    m(**inputs).loss.backward()
    assert all(m.get_parameter(n).grad is not None for n in get_state(m).param_names)
    merge(m)  # unmerged module by module instead: the guard steps aside as well
    for mod in adapter_modules(m).values():
        mod.unmerge()
    m.zero_grad()
    m(**inputs).loss.backward()
    assert all(m.get_parameter(n).grad is not None for n in get_state(m).param_names)


def test_unmerge_removes_the_training_guards():
    # merge() registers one guard hook per adapter module and unmerge() removes them: an
    # unmerge that only forgot the handles left the hooks on every module, and each further
    # merge added one more (a forward hook per module per merge/unmerge cycle, for good)
    m = _gpt2(seed_fill=1)
    mods = adapter_modules(m)
    before = {n: len(mod._forward_hooks) for n, mod in mods.items()}
    for _ in range(3):
        merge(m)
        assert all(len(mod._forward_hooks) == before[n] + 1 for n, mod in mods.items())
        unmerge(m)
        assert {n: len(mod._forward_hooks) for n, mod in mods.items()} == before


# ------------------------------------------------------------------------------------------
# a hostile probe's findings (stop 29)


def test_leftover_names_alone_never_make_a_file_removable(tmp_path):
    """Names of kfused's pattern from another host, older than a day: removed only when their
    content shows kfused wrote them (a user's folder of that name, holding a PEFT-named file,
    and a temp file that is not kfused's JSON are kept)."""
    d = tmp_path / "c"
    save(tiny(fill=1.0), str(d))
    old = "20200101T000000-deadbeef-1-abcdef12"
    theirs = d / (ck.VERSION_PREFIX + old)
    theirs.mkdir()
    (theirs / ck.WEIGHTS).write_bytes(b"user weights, not safetensors")
    their_tmp = d / f".{ck.POINTER}.{old}.tmp"
    their_tmp.write_text('{"note": "mine"}')
    ours_old = "20200101T000000-deadbeef-2-abcdef13"
    ours = d / (ck.VERSION_PREFIX + ours_old)
    shutil.copytree(version_folder(d), ours)
    ours_tmp = d / f".{ck.POINTER}.{ours_old}.tmp"
    ours_tmp.write_text((d / ck.POINTER).read_text())
    half = d / (ck.VERSION_PREFIX + "20200101T000000-deadbeef-3-abcdef14")
    half.mkdir()  # killed before its description: a weights file with kfused's header
    (half / ck.WEIGHTS).write_bytes((version_folder(d) / ck.WEIGHTS).read_bytes()[:-4])
    save(tiny(fill=2.0), str(d))
    assert theirs.is_dir() and (theirs / ck.WEIGHTS).read_bytes() == b"user weights, not safetensors"
    assert their_tmp.read_text() == '{"note": "mine"}'
    assert not ours.exists() and not ours_tmp.exists() and not half.exists()
    assert states_equal(loaded(d), adapter_state_dict(tiny(fill=2.0)))


def test_load_with_another_config_is_refused(tmp_path):
    """Same method and shapes but another scale: the tensors would act differently, so load
    into an injected model refuses and names the field; a fresh model takes the saved config."""
    d = tmp_path / "c"
    torch.manual_seed(0)
    src = Tiny()
    inject(src, AdapterConfig(method="lora", targets=["fc1", "fc2"], r=4, alpha=32,
                              init="random", backend="reference"))
    save(src, str(d))
    x = torch.randn(3, 16)
    torch.manual_seed(0)
    dst = Tiny()
    inject(dst, AdapterConfig(method="lora", targets=["fc1", "fc2"], r=4, alpha=8,
                              backend="reference"))
    before = adapter_state_dict(dst)
    with pytest.raises(CheckpointError, match="alpha: checkpoint 32, model 8"):
        load(dst, str(d))
    assert states_equal(adapter_state_dict(dst), before)
    torch.manual_seed(0)
    fresh = Tiny()
    load(fresh, str(d))
    torch.testing.assert_close(fresh(x), src(x), rtol=0, atol=0)
    # what does not change the tensors' meaning may differ (backend, dropout, init)
    torch.manual_seed(0)
    other = Tiny()
    inject(other, AdapterConfig(method="lora", targets=["fc1", "fc2"], r=4, alpha=32,
                                dropout=0.1, init="zero", backend="reference"))
    load(other, str(d))
    other.eval()
    torch.testing.assert_close(other(x), src(x), rtol=0, atol=0)
    # nor the same number written another way (alpha 32.0: from_peft records scaling·r)
    torch.manual_seed(0)
    same = Tiny()
    inject(same, AdapterConfig(method="lora", targets=["fc1", "fc2"], r=4, alpha=32.0,
                               backend="reference"))
    load(same, str(d))
    torch.testing.assert_close(same(x), src(x), rtol=0, atol=0)


def test_load_with_another_krona_scale_is_refused(tmp_path):
    """KronA's scale (not LoRA's alpha) carries its update's size: the same factor tensors
    loaded into a model injected with another scale would act differently, so load refuses
    and names the field (the check covered alpha alone; a field list without "scale" loaded
    s = 2 factors into an s = 1 model silently)."""
    d = tmp_path / "k"
    torch.manual_seed(0)
    src = Tiny()
    inject(src, AdapterConfig(method="krona", targets=["fc1", "fc2"], scale=2.0,
                              init="random", backend="reference"))
    save(src, str(d))
    torch.manual_seed(0)
    dst = Tiny()
    inject(dst, AdapterConfig(method="krona", targets=["fc1", "fc2"], backend="reference"))
    before = adapter_state_dict(dst)
    with pytest.raises(CheckpointError, match="scale: checkpoint 2.0, model 1.0"):
        load(dst, str(d))
    assert states_equal(adapter_state_dict(dst), before)
    x = torch.randn(3, 16)
    torch.manual_seed(0)
    fresh = Tiny()
    load(fresh, str(d))
    torch.testing.assert_close(fresh(x), src(x), rtol=0, atol=0)


def test_load_backend_argument_overrides_the_saved_backend(tmp_path):
    """load(backend=...) injects with that kernel backend instead of the saved config's (the
    argument was ignored unnoticed: every test loaded with the saved backend)."""
    d = tmp_path / "b"
    src = tiny()                                   # saved with backend="reference"
    save(src, str(d))
    torch.manual_seed(0)
    fresh = Tiny()
    load(fresh, str(d), backend="triton")
    assert get_state(fresh).config.backend == "triton"
    mods = adapter_modules(fresh)
    assert mods and all(m.backend == "triton" for m in mods.values())
    assert states_equal(adapter_state_dict(fresh), adapter_state_dict(src))
    torch.manual_seed(0)
    plain = Tiny()
    load(plain, str(d))
    assert all(m.backend == "reference" for m in adapter_modules(plain).values())


def test_load_takes_alpha_none_and_alpha_r_as_one_scale(tmp_path):
    """alpha=None means alpha = r (scale 1): a checkpoint saved either way loads into a model
    injected the other way; another alpha is refused (None is compared as r)."""
    x = torch.randn(3, 16)
    for saved_alpha, model_alpha in ((None, 4), (4, None), (4.0, None)):
        d = tmp_path / f"c{saved_alpha}_{model_alpha}"
        torch.manual_seed(0)
        src = inject(Tiny(), AdapterConfig(method="lora", targets=["fc1", "fc2"], r=4,
                                           alpha=saved_alpha, init="random",
                                           backend="reference"))
        save(src, str(d))
        torch.manual_seed(0)
        dst = inject(Tiny(), AdapterConfig(method="lora", targets=["fc1", "fc2"], r=4,
                                           alpha=model_alpha, backend="reference"))
        load(dst, str(d))
        torch.testing.assert_close(dst(x), src(x), rtol=0, atol=0)
    torch.manual_seed(0)
    other = inject(Tiny(), AdapterConfig(method="lora", targets=["fc1", "fc2"], r=4, alpha=8,
                                         backend="reference"))
    with pytest.raises(CheckpointError, match="alpha: checkpoint 4, model 8"):
        load(other, str(tmp_path / "cNone_4"))


def test_load_with_the_same_krona_shapes_spelled_out(tmp_path):
    """KronA factor shapes left to their default (from_peft records a_shape=None when they fit)
    and the same shapes given explicitly are one adapter: load takes the checkpoint; other
    shapes are refused by the tensor shapes."""
    d = tmp_path / "c"
    torch.manual_seed(0)
    src = inject(Tiny(), AdapterConfig(method="krona", targets=["fc1"], scale=2.0,
                                       init="random", backend="reference"))
    save(src, str(d))
    a_shape = tuple(src.fc1.A.shape)
    x = torch.randn(3, 16)
    torch.manual_seed(0)
    dst = inject(Tiny(), AdapterConfig(method="krona", targets=["fc1"], scale=2.0,
                                       a_shape=a_shape, backend="reference"))
    load(dst, str(d))
    torch.testing.assert_close(dst(x), src(x), rtol=0, atol=0)
    other = inject(Tiny(), AdapterConfig(method="krona", targets=["fc1"], scale=2.0,
                                         a_shape=(a_shape[0] * 2, a_shape[1]),
                                         backend="reference"))
    with pytest.raises(CheckpointError, match="shape mismatch"):
        load(other, str(d))


@pytest.mark.parametrize("training", [False, True])
def test_load_keeps_the_model_mode(training, tmp_path):
    """load injects into a model without adapters: the adapters take the model's mode (they
    started in training mode, so an eval-mode model ran its LoRA dropout at inference)."""
    torch.manual_seed(0)
    src = inject(Tiny(), AdapterConfig(method="lora", targets=["fc1", "fc2"], dropout=0.5,
                                       init="random", backend="reference")).eval()
    save(src, str(tmp_path / "c"))
    torch.manual_seed(0)
    dst = Tiny().train(training)
    load(dst, str(tmp_path / "c"))
    assert {m.training for m in dst.modules()} == {training}
    if not training:
        x = torch.randn(3, 16)
        torch.testing.assert_close(dst(x), src(x), rtol=0, atol=0)


def test_refused_load_leaves_an_uninjected_model_uninjected(tmp_path):
    d = tmp_path / "c"
    save(tiny(fill=1.0), str(d))

    class Wider(nn.Module):  # same class name and names, other widths
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(16, 32)
            self.fc2 = nn.Linear(32, 8)

    Wider.__name__ = "Tiny"
    m = Wider()
    before = {n: p.detach().clone() for n, p in m.state_dict().items()}
    with pytest.raises(CheckpointError, match="shape mismatch"):
        load(m, str(d))
    assert get_state(m, required=False) is None
    assert isinstance(m.fc1, nn.Linear) and isinstance(m.fc2, nn.Linear)
    assert all(p.requires_grad for p in m.parameters())
    assert m.state_dict().keys() == before.keys()
    assert all(torch.equal(m.state_dict()[n], t) for n, t in before.items())
    inject(m, AdapterConfig(method="lora", targets=["fc1", "fc2"]))  # still injectable


@pytest.mark.parametrize("fn", [save, load, read_checkpoint_config])
def test_directory_must_be_a_path(fn):
    args = (None,) if fn is read_checkpoint_config else (tiny(), None)
    with pytest.raises(TypeError, match="directory must be a path"):
        fn(*args)


@pytest.mark.parametrize("fn", [save, load, read_checkpoint_config])
def test_empty_directory_names_no_folder(fn, tmp_path, monkeypatch):
    # save(model, '') wrote the checkpoint into the working directory (abspath('') is the cwd)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_notes.txt").write_text("user file")
    args = ("",) if fn is read_checkpoint_config else (tiny(), "")
    with pytest.raises(ValueError, match=f"{fn.__name__}: directory '' names no folder"):
        fn(*args)
    assert os.listdir(tmp_path) == ["my_notes.txt"]


def test_width_mismatch_names_both_models(tmp_path):
    """A checkpoint from a d_model = 32 model loaded into a d_model = 48 one: the refusal
    gives both widths (it named the saved one only)."""
    pytest.importorskip("transformers")
    src = make("gpt2", d_model=32)
    inject(src, AdapterConfig(method="lora", backend="reference"))
    save(src, str(tmp_path / "c"))
    with pytest.raises(CheckpointError, match=r"d_model=32; this model: GPT2LMHeadModel "
                                              r"d_model=48"):
        load(make("gpt2", d_model=48), str(tmp_path / "c"))
