"""Issue 5, item 4: the adapted model under DDP and FSDP2 (gloo, 2 CPU processes) matches a
single-process run on the same global batch: gradients, trained adapter weights, checkpoints."""

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORLD = 2
STEPS = 3
GLOBAL_BATCH = 4


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup_paths():
    for p in (ROOT, HERE):
        if p not in sys.path:
            sys.path.insert(0, p)


def _global_batch():
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(3, 128, (GLOBAL_BATCH, 16), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


# method -> targets of the runs compared with one process (krona_b_res: 0-d s_res parameters)
RUN_TARGETS = {"krona": ["qkv", "ffn_out"], "krona_b_res": None}


def _run(mode, rank=0, world=1, ckpt_dir=None, method="krona"):
    """Train STEPS steps; return (first-step adapter grads, final adapter weights)."""
    _setup_paths()
    from _hf_helpers import make

    from kfused import distributed as kd
    from kfused.integration import AdapterConfig, adapter_state_dict, inject, save, unwrap

    model = make("gpt2")
    inject(model, AdapterConfig(method=method, targets=RUN_TARGETS[method], init="random",
                                backend="reference"))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    model = kd.wrap_model(model, mode, torch.device("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-2)
    batch = _global_batch()
    if world > 1:
        batch = kd.shard_batch(batch, rank, world)
    grads = None
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        if step == 0:
            inner = unwrap(model)
            grads = {}
            for n in names:
                g = inner.get_parameter(n).grad
                grads[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        opt.step()
    weights = adapter_state_dict(model)
    if ckpt_dir is not None:
        save(model, ckpt_dir)
        if mode == "fsdp2":  # load back into a freshly sharded model: shards re-distributed
            from kfused.integration import load

            fresh = make("gpt2", seed=7)
            inject(fresh, AdapterConfig(method=method, targets=RUN_TARGETS[method],
                                        backend="reference"))
            fresh = kd.wrap_model(fresh, mode, torch.device("cpu"))
            load(fresh, ckpt_dir)
            again = adapter_state_dict(fresh)
            assert all(torch.equal(again[k], weights[k]) for k in weights), "FSDP2 reload"
    return grads, weights


def _worker(rank, world, init_file, out_dir):
    # Rendezvous through a file of this run's own (a FileStore), not a TCP port: a port found
    # free by one process can be taken by another before the store binds it, and two test
    # processes on one port join each other's groups. One CI run (seed 1707881029) ended with
    # rank 0 aborted ("terminate called without an active exception") and every test of this
    # fixture in error; not reproduced, this race is one way to get there.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        results = {}
        for mode in ("ddp", "fsdp2"):
            torch.manual_seed(0)
            try:
                results[mode] = _run(mode, rank, world, ckpt_dir=os.path.join(out_dir, mode))
            except Exception as exc:  # reported to the test, which decides
                results[mode] = f"{type(exc).__name__}: {exc}"
            dist.barrier()
        torch.manual_seed(0)
        try:  # fully_shard refused KronA^B_res's 0-d s_res
            results["fsdp2_krona_b_res"] = _run("fsdp2", rank, world, method="krona_b_res",
                                                ckpt_dir=os.path.join(out_dir, "fsdp2_b_res"))
        except Exception as exc:
            results["fsdp2_krona_b_res"] = f"{type(exc).__name__}: {exc}"
        dist.barrier()
        from kfused import distributed as kd
        try:  # a world that is not the process group's would give each rank a wrong slice
            kd.shard_batch(_global_batch(), rank, 2 * world)
            results["shard_world_mismatch"] = "no error"
        except ValueError as exc:
            results["shard_world_mismatch"] = str(exc)
        try:  # so would another rank's index (both ranks took the same half)
            kd.shard_batch(_global_batch(), (rank + 1) % world, world)
            results["shard_rank_mismatch"] = "no error"
        except ValueError as exc:
            results["shard_rank_mismatch"] = str(exc)
        results["ranks_differ"] = _ranks_differ(rank)
        results["merge_lite_fsdp2"] = _merge_lite_fsdp2()
        results["wrap_twice"] = _wrap_twice()
        for mode in ("ddp", "fsdp2"):
            results[f"to_peft_{mode}"] = _to_peft(mode, out_dir)
        for mode in ("ddp", "fsdp2"):
            results[f"inject_after_{mode}"] = _adapt_a_wrapped_model(mode, out_dir)
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "results.pt"))
        _save_fails_on_rank_0(rank, out_dir)  # last: before the fix it left the ranks out of step
    finally:
        dist.destroy_process_group()


def _adapt_a_wrapped_model(mode, out_dir):
    """inject / load (which injects) / from_peft into a model already wrapped by DDP / FSDP2:
    refused (the wrapper never synchronised the new adapters' gradients: each rank trained
    its own)."""
    _setup_paths()
    from _hf_helpers import make

    from kfused import distributed as kd
    from kfused.integration import AdapterConfig, get_state, inject, load

    out = []
    for how in ("inject", "load", "from_peft"):
        model = kd.wrap_model(make("gpt2"), mode, torch.device("cpu"))
        try:
            if how == "inject":
                inject(model, AdapterConfig(method="lora", targets=["qkv"], backend="reference"))
            elif how == "load":
                load(model, os.path.join(out_dir, "ddp"))
            else:
                from kfused.integration.peft_interop import from_peft

                from_peft(model, os.path.join(out_dir, "peft_ddp"))  # the folder _to_peft wrote
            got = "no error"
        except Exception as exc:
            got = f"{type(exc).__name__}: {exc}"
        if get_state(model, required=False) is not None:  # a refused call changes nothing
            got += " [model changed]"
        out.append(got)
    return out


def _ranks_differ(rank):
    """(a) LoRA's alpha differs between ranks: wrap_model refused? (b) a per-rank seed before
    inject(init="random"): does every rank start from rank 0's adapters (FSDP2 kept a mixture
    of the ranks' shards)?"""
    _setup_paths()
    from _hf_helpers import make

    from kfused import distributed as kd
    from kfused.integration import AdapterConfig, adapter_state_dict, inject

    out = {}
    for mode in ("ddp", "fsdp2"):
        model = inject(make("gpt2"), AdapterConfig(method="lora", targets=["qkv"],
                                                   alpha=4 if rank == 0 else 64,
                                                   backend="reference"))
        try:
            kd.wrap_model(model, mode, torch.device("cpu"))
            out["alpha", mode] = "no error"
        except ValueError as exc:
            out["alpha", mode] = str(exc)
        model = make("gpt2")
        torch.manual_seed(100 + rank)
        inject(model, AdapterConfig(method="lora", targets=["qkv"], init="random",
                                    backend="reference"))
        mine = adapter_state_dict(model)
        got = adapter_state_dict(kd.wrap_model(model, mode, torch.device("cpu")))
        theirs = [None] * dist.get_world_size()
        dist.all_gather_object(theirs, mine)
        differed = any(not torch.equal(theirs[0][k], theirs[1][k]) for k in mine)
        out["seed", mode] = differed, all(torch.equal(got[k], theirs[0][k]) for k in mine)
    return out


def _merge_lite_fsdp2():
    """Max |logits merged - unmerged| of the lite methods under FSDP2 (merge had failed:
    'aten.index_select.default got mixed torch.Tensor and DTensor')."""
    _setup_paths()
    from _hf_helpers import make

    from kfused import distributed as kd
    from kfused.integration import AdapterConfig, inject, merge

    out = {}
    for method in ("kernel_wise_lite", "kernel_mix_lite"):
        torch.manual_seed(0)
        model = inject(make("gpt2"), AdapterConfig(method=method, init="random",
                                                   backend="reference"))
        model = kd.wrap_model(model, "fsdp2", torch.device("cpu")).eval()
        ids = _global_batch()["input_ids"][:1]
        try:
            with torch.no_grad():
                y0 = model(input_ids=ids).logits
                merge(model)
                out[method] = (model(input_ids=ids).logits - y0).abs().max().item()
        except Exception as exc:
            out[method] = f"{type(exc).__name__}: {exc}"
    return out


def _wrap_twice():
    _setup_paths()
    from _hf_helpers import make

    from kfused import distributed as kd
    from kfused.integration import AdapterConfig, inject

    out = {}
    for first, second in (("ddp", "ddp"), ("fsdp2", "fsdp2"), ("ddp", "fsdp2"), ("fsdp2", "ddp")):
        model = inject(make("gpt2"), AdapterConfig(method="lora", targets=["qkv"],
                                                   backend="reference"))
        model = kd.wrap_model(model, first, torch.device("cpu"))
        try:
            kd.wrap_model(model, second, torch.device("cpu"))
            out[first, second] = "no error"
        except Exception as exc:
            out[first, second] = f"{type(exc).__name__}: {exc}"
    return out


def _to_peft(mode, out_dir):
    """to_peft from every rank of a wrapped model: (the adapters, the error or None)."""
    _setup_paths()
    from _hf_helpers import make

    from kfused import distributed as kd
    from kfused.integration import AdapterConfig, adapter_state_dict, inject

    model = inject(make("gpt2"), AdapterConfig(method="lora", targets=["qkv"], init="random",
                                               backend="reference"))
    weights = adapter_state_dict(model)
    model = kd.wrap_model(model, mode, torch.device("cpu"))
    try:
        from kfused.integration.peft_interop import to_peft

        to_peft(model, os.path.join(out_dir, f"peft_{mode}"))
        return weights, None
    except Exception as exc:
        return weights, f"{type(exc).__name__}: {exc}"


def _save_fails_on_rank_0(rank, out_dir):
    """save() into a path that is a regular file: rank 0 refuses it; every rank must raise
    (rank 1 returned as if saved, or waited in a barrier rank 0 never reached)."""
    _setup_paths()
    from _hf_helpers import make

    from kfused.integration import AdapterConfig, inject, save

    model = make("gpt2")
    inject(model, AdapterConfig(method="lora", targets=["qkv"], backend="reference"))
    target = os.path.join(out_dir, "a_file")
    if rank == 0:
        with open(target, "w") as f:
            f.write("not a checkpoint")
    dist.barrier()
    try:
        save(model, target)
        outcome = "no error"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out_dir, f"save_into_file-{rank}.txt"), "w") as f:
        f.write(outcome)


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dist"))
    init_file = os.path.join(str(tmp_path_factory.mktemp("rendezvous")), "store")
    mp.start_processes(_worker, args=(WORLD, init_file, out), nprocs=WORLD, join=True,
                       start_method="spawn")
    return out, torch.load(os.path.join(out, "results.pt"), weights_only=False)


@pytest.fixture(scope="module")
def single():
    torch.manual_seed(0)
    return _run("none")


def _compare(multi_res, single_res):
    assert not isinstance(multi_res, str), multi_res
    (g_m, w_m), (g_s, w_s) = multi_res, single_res
    assert g_m.keys() == g_s.keys() and w_m.keys() == w_s.keys()
    for k in g_s:
        assert g_s[k].abs().sum() > 0, k
        torch.testing.assert_close(g_m[k], g_s[k], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"grad {k}: {m}")
    for k in w_s:
        torch.testing.assert_close(w_m[k], w_s[k], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"weight {k}: {m}")


def test_ddp_matches_single_process(multi, single):
    _compare(multi[1]["ddp"], single)


def test_fsdp2_matches_single_process(multi, single):
    res = multi[1]["fsdp2"]
    if isinstance(res, str) and ("not supported" in res or "NotImplemented" in res):
        pytest.skip(f"FSDP2 on this CPU build: {res} (run this test on the GPU)")
    _compare(res, single)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_distributed_checkpoint_loads_single_process(multi, single, mode):
    if isinstance(multi[1][mode], str):
        pytest.skip(multi[1][mode])
    _setup_paths()
    from _hf_helpers import make

    from kfused.integration import adapter_state_dict, load

    fresh = make("gpt2")
    load(fresh, os.path.join(multi[0], mode))
    got = adapter_state_dict(fresh)
    for k, v in multi[1][mode][1].items():
        assert torch.equal(got[k], v), k


def test_shard_batch_refuses_a_world_other_than_the_process_groups(multi):
    assert "the process group has 2 ranks" in multi[1]["shard_world_mismatch"]


def test_shard_batch_refuses_a_rank_other_than_this_processs(multi):
    # rank 0 passed rank_=1 (was: rank 1's slice, and no rank trained on rank 0's)
    got = multi[1]["shard_rank_mismatch"]
    assert got.startswith("shard_batch: rank_=1 but this process is rank 0"), got


@pytest.fixture(scope="module")
def single_b_res():
    torch.manual_seed(0)
    return _run("none", method="krona_b_res")


def test_fsdp2_krona_b_res_matches_single_process(multi, single_b_res):
    """KronA^B_res's 0-d s_res: fully_shard refused it ('doesn't support scalar
    parameters'); it now stays whole on each rank with its gradient averaged, and the FSDP2
    checkpoint reloads (in _run)."""
    res = multi[1]["fsdp2_krona_b_res"]
    assert not isinstance(res, str), res
    assert any(k.endswith("res_scale") and v.dim() == 0 for k, v in res[1].items())
    _compare(res, single_b_res)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_wrap_model_refuses_adapter_configs_that_differ_between_ranks(multi, mode):
    got = multi[1]["ranks_differ"]["alpha", mode]
    assert got.startswith(f"wrap_{mode}: the kfused adapter config differs between ranks "
                          "(ranks [1] differ from rank 0)"), got
    assert "alpha 4 on rank 0 but 64 on rank 1" in got, got


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_every_rank_starts_from_rank_0s_adapters(multi, mode):
    """A per-rank seed before inject(init="random"): FSDP2 sharded each rank's own values (a
    mixture no rank initialised); both wrappers now start from rank 0's."""
    differed, from_rank_0 = multi[1]["ranks_differ"]["seed", mode]
    assert differed and from_rank_0


@pytest.mark.parametrize("method", ["kernel_wise_lite", "kernel_mix_lite"])
def test_fsdp2_merge_of_a_lite_method(multi, method):
    got = multi[1]["merge_lite_fsdp2"][method]
    assert not isinstance(got, str), got
    assert got < 1e-4, got


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_inject_or_load_into_a_wrapped_model_is_refused(multi, mode):
    inj, ld, peft = multi[1][f"inject_after_{mode}"]
    wrapper = "DistributedDataParallel" if mode == "ddp" else "FSDP2"
    for got in (inj, ld) + ((peft,) if importlib.util.find_spec("peft") else ()):
        assert "already wrapped for multi-process training" in got and wrapper in got, got
        assert "[model changed]" not in got, got
    assert ld.startswith("CheckpointError: cannot inject"), ld


def test_wrap_model_refuses_a_wrapped_model(multi):
    """DDP over DDP all-reduced twice, FSDP2 twice tripped an assertion inside torch, DDP over
    FSDP2 failed in a collective without a sharding strategy."""
    for (first, second), got in multi[1]["wrap_twice"].items():
        wrapper = "DistributedDataParallel" if first == "ddp" else "FSDP2: fully_shard"
        assert got.startswith("ValueError: wrap_model: the model is already wrapped") \
            and wrapper in got, (first, second, got)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_to_peft_of_a_wrapped_model(multi, mode):
    """FSDP2's sharded adapters are gathered (to_peft failed inside safetensors on a DTensor:
    'invalid python storage'); the export holds the full tensors."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    weights, err = multi[1][f"to_peft_{mode}"]
    assert err is None, err
    got = load_file(os.path.join(multi[0], f"peft_{mode}", "adapter_model.safetensors"))
    for name, letter in ((n, n.rsplit(".", 1)[1]) for n in weights):
        key = f"base_model.model.{name.rsplit('.', 1)[0]}.lora_{letter}.weight"
        assert torch.equal(got[key], weights[name]), key


def test_save_failing_on_rank_0_raises_on_every_rank(multi):
    outcomes = []
    for r in range(WORLD):
        with open(os.path.join(multi[0], f"save_into_file-{r}.txt")) as f:
            outcomes.append(f.read())
    assert outcomes[0].startswith("CheckpointError: cannot save to"), outcomes[0]
    for r in range(1, WORLD):
        assert outcomes[r].startswith("CheckpointError: save to"), outcomes[r]
        assert "failed on rank 0" in outcomes[r] and "it exists and is a regular file" \
            in outcomes[r], outcomes[r]
    with open(os.path.join(multi[0], "a_file")) as f:
        assert f.read() == "not a checkpoint"


def test_bad_inputs_without_a_process_group():
    from torch import nn

    from kfused import distributed as kd

    batch = _global_batch()
    for rank, world, match in ((2, 2, r"rank_ must be in \[0, 2\).*got 2"),
                               (-1, 2, r"rank_ must be in \[0, 2\).*got -1"),
                               (0, 0, "world must be >= 1, got 0"),
                               (0, -2, "world must be >= 1, got -2")):
        with pytest.raises(ValueError, match=match):  # was an empty or wrong slice
            kd.shard_batch(batch, rank, world)
    with pytest.raises(TypeError, match="global batch n is a 0-d tensor"):
        kd.shard_batch({"n": torch.tensor(3)}, 0, 1)
    with pytest.raises(TypeError, match="global batch ids is a list"):
        kd.shard_batch({"ids": [1, 2]}, 0, 1)
    with pytest.raises(TypeError, match="world must be an int"):
        kd.shard_batch(batch, 0, 2.0)
    with pytest.raises(TypeError, match=r"mode 'none' .* got \['mp_dtype'\]"):  # was dropped
        kd.wrap_model(nn.Linear(2, 2), "none", torch.device("cpu"), mp_dtype=torch.bfloat16)
    for mode in ("ddp", "fsdp2"):  # fsdp2 failed on torch's env:// rendezvous (RANK not set)
        with pytest.raises(RuntimeError, match=f"mode '{mode}' needs an initialized process"):
            kd.wrap_model(nn.Linear(2, 2), mode, torch.device("cpu"))


@pytest.mark.parametrize("env, match", [
    (dict(RANK="abc", WORLD_SIZE="2"), r"RANK='abc' must be an integer"),
    (dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="x"), r"LOCAL_RANK='x' must be an integer"),
    (dict(RANK="2", WORLD_SIZE="2"), r"RANK=2 must be in \[0, WORLD_SIZE=2\)"),  # was a timeout
    (dict(RANK="-1", WORLD_SIZE="2"), r"RANK=-1 must be in \[0, WORLD_SIZE=2\)"),
    (dict(RANK="0", WORLD_SIZE="0"), r"WORLD_SIZE=0 must be >= 1"),
])
def test_init_distributed_refuses_a_bad_environment(monkeypatch, env, match):
    from kfused import distributed as kd

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        with pytest.raises(ValueError, match=match):
            kd.init_distributed(timeout_s=2)
    finally:
        if dist.is_initialized():  # never leave a process group behind
            dist.destroy_process_group()


def test_demo_torchrun_ddp(tmp_path):
    """`torchrun --nproc-per-node 2 -m kfused.cli.demo --distributed ddp` on the CPU (gloo)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_free_port()), "-m", "kfused.cli.demo", "--distributed", "ddp",
           "--steps", "3", "--base", "random", "--methods", "lora", "--gen-examples", "2",
           "--max-new-tokens", "4", "--layers", "1", "--d-model", "32", "--heads", "2",
           "--seq-len", "32", "--loss", "all",  # no training sentence starts by byte 32
           "--batch-size", "4", "--warmup", "1", "--no-progress", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ddp x 2" in proc.stdout
    assert os.path.exists(tmp_path / "demo.json")


def test_demo_ddp_trains_on_the_single_process_loss(tmp_path):
    """Each rank's loss was the mean over its own target tokens and DDP averaged the means:
    halves of the global batch with different token counts trained on another loss than
    one process (step 1's loss and the eval loss differed)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    args = ["--steps", "2", "--base", "random", "--methods", "lora", "--gen-examples", "0",
            "--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "160",
            "--batch-size", "4", "--warmup", "1", "--no-progress", "--lr", "0.05"]
    runs = {}
    for how, launch in (("single", []), ("ddp", ["-m", "torch.distributed.run",
                                                 "--nproc-per-node", "2", "--master-port",
                                                 str(_free_port())])):
        out = tmp_path / how
        cmd = [sys.executable, *launch, "-m", "kfused.cli.demo", *args, "--out", str(out)]
        if how == "ddp":
            cmd += ["--distributed", "ddp"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240,
                              cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(out / "demo.json") as f:
            runs[how] = json.load(f)["runs"]["lora"]["reference"]
    s, d = runs["single"], runs["ddp"]
    torch.testing.assert_close(d["losses"], s["losses"], rtol=1e-5, atol=1e-5)
    assert abs(d["eval_loss"] - s["eval_loss"]) < 1e-5, (d["eval_loss"], s["eval_loss"])
