"""`kfused demo` (issue 18): the shipped pretrained base, its pretraining script and corpus, the
task metrics, and the demo's CPU path (reference only, said so), report, plot and determinism."""

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sacrebleu")

from kfused.cli.demo import build_parser, run_demo  # noqa: E402
from kfused.data import load_pairs  # noqa: E402
from kfused.data import e2e_metrics as em  # noqa: E402
from kfused.data.make_corpus import LANDMARKS, VENUE_NAMES, documents  # noqa: E402
from kfused.data.make_e2e import NAMES, NEAR  # noqa: E402
from kfused.data.pretrain_base import BASE_DIR  # noqa: E402

TINY = ["--base", "random", "--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len",
        "64", "--batch-size", "4", "--warmup", "1", "--gen-examples", "3", "--max-new-tokens",
        "6", "--no-progress", "--device", "cpu"]


def test_demo_cpu_reference_only_report_and_plot(tmp_path, capsys):
    rc = run_demo(TINY + ["--steps", "4", "--methods", "lora,inducer_lora", "--out",
                          str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    # the CPU path says that only the reference runs, and why
    assert "reference only" in out and "fused run skipped" in out and "CUDA GPU" in out
    assert "BLEU" in out and "slot acc" in out and "frozen base" in out
    report = json.loads((tmp_path / "demo.json").read_text())
    assert [r["label"] for r in report["rows"]] == ["frozen base", "LoRA", "inducer+LoRA"]
    assert report["rows"][0]["trainable_params"] == 0
    for row in report["rows"][1:]:
        assert 0 < row["trainable_params"] < row["total_params"]
        assert {"bleu", "slot_accuracy", "all_slots", "eval_loss"} <= set(row)
    assert set(report["runs"]["lora"]) == {"reference"}  # no fused run on the CPU
    assert len(report["runs"]["lora"]["reference"]["losses"]) == 4
    assert report["skipped"]["fused"] and not report["fused_vs_reference"]
    assert report["checkpoint"]["lora"]["reload_bit_exact"] is True
    assert "merge_max_abs_logit_change" in report["checkpoint"]["lora"]
    assert os.path.getsize(tmp_path / "demo.png") > 1000


def test_demo_runs_reference_explicitly(tmp_path, capsys):
    # `--runs reference` used to raise IndexError after training (no note to report)
    rc = run_demo(TINY + ["--steps", "2", "--methods", "krona", "--runs", "reference",
                          "--gen-examples", "0", "--out", str(tmp_path)])
    assert rc == 0
    assert "not requested (--runs reference)" in capsys.readouterr().out


def test_demo_deterministic(tmp_path):
    args = TINY + ["--steps", "3", "--methods", "kernel_mix"]
    reports = []
    for i in range(2):
        assert run_demo(args + ["--out", str(tmp_path / str(i))]) == 0
        reports.append(json.loads((tmp_path / str(i) / "demo.json").read_text()))
    a, b = reports
    assert a["runs"]["kernel_mix"]["reference"]["losses"] == \
        b["runs"]["kernel_mix"]["reference"]["losses"]
    assert [r.get("samples") for r in a["rows"]] == [r.get("samples") for r in b["rows"]]


def test_demo_bad_method_is_a_usage_error(tmp_path, capsys):
    assert run_demo(TINY + ["--methods", "no_such_method", "--out", str(tmp_path)]) == 2
    assert "no_such_method" in capsys.readouterr().err
    # a name given twice: two table rows, but one entry in the report's runs (the second
    # overwrote the first) and one checkpoint folder saved twice
    assert run_demo(TINY + ["--methods", "lora,krona,lora", "--out", str(tmp_path)]) == 2
    assert "names lora more than once" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_demo_targets_the_model_lacks_are_a_usage_error(tmp_path, capsys):
    # only the configuration was checked up front: targets no module matches, or a preset's
    # KronA shapes for another width, failed inside inject with a ValueError traceback after
    # the frozen base's evaluation (and an empty --out folder made)
    for argv, text in [(["--methods", "lora", "--targets", "nosuch"],
                        "LoRA: method 'lora': no module of this model matched targets"),
                       (["--methods", "kernel_mix", "--targets", "ffn_in"],
                        "targets must be among q, v, o"),
                       (["--preset", "krona-glue"], "give a (768, 768) update")]:
        assert run_demo(TINY + argv + ["--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kfused demo: ") and text in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_demo_local_checkpoint_dir(tmp_path, capsys):
    from kfused.integration.models import tiny_model

    torch.manual_seed(0)
    tiny_model("gpt2", d_model=32, n_layers=1, n_heads=2, vocab=200).save_pretrained(
        tmp_path / "gpt2-local")  # smaller vocab than the byte tokenizer: embeddings resized
    rc = run_demo(["--model-dir", str(tmp_path / "gpt2-local"), "--method", "lora", "--steps",
                   "2", "--seq-len", "32", "--loss", "all",  # no sentence starts by byte 32
                   "--batch-size", "2", "--warmup", "0",
                   "--gen-examples", "2", "--max-new-tokens", "4", "--no-progress",
                   "--device", "cpu", "--out", str(tmp_path / "out")])
    assert rc == 0
    assert "from " + str(tmp_path / "gpt2-local") in capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "demo.json").read_text())
    assert report["checkpoint"]["lora"]["reload_bit_exact"] is True


def test_demo_names_the_architecture_it_ran(tmp_path, capsys):
    # a --model-dir Llama checkpoint ran, but the run line and the report's title said
    # "GPT-2-shaped"
    from kfused.integration.models import tiny_model

    torch.manual_seed(0)
    tiny_model("llama", d_model=32, n_layers=1, n_heads=2, vocab=260).save_pretrained(
        tmp_path / "llama-local")
    assert run_demo(["--model-dir", str(tmp_path / "llama-local"), "--method", "lora",
                     "--steps", "1", "--seq-len", "32", "--loss", "all", "--batch-size", "2",
                     "--gen-examples", "0", "--no-progress", "--device", "cpu",
                     "--out", str(tmp_path / "out")]) == 0
    assert "LoRA on a llama model (from " in capsys.readouterr().out
    title = json.loads((tmp_path / "out" / "demo.json").read_text())["title"]
    assert "llama" in title and "GPT-2" not in title, title


def test_demo_says_when_it_generates_fewer_examples_than_asked(tmp_path, capsys):
    # --gen-examples beyond the 60 held-out examples scored 60 without a word
    assert run_demo(TINY + ["--steps", "1", "--methods", "krona", "--gen-examples", "100",
                            "--max-new-tokens", "1", "--out", str(tmp_path)]) == 0
    assert "note: --gen-examples 100: there are 60 held-out examples" in capsys.readouterr().out
    report = json.loads((tmp_path / "demo.json").read_text())
    assert len(report["heldout_mrs"]) == 60
    assert any(n.startswith("--gen-examples 100") for n in report["notes"])


def test_demo_says_when_no_step_is_timed(tmp_path, capsys):
    # --warmup >= --steps: tokens/s was nan (a "-" in the table) without a word why
    assert run_demo(TINY + ["--steps", "2", "--warmup", "2", "--methods", "krona",
                            "--gen-examples", "0", "--out", str(tmp_path)]) == 0
    assert "note: --warmup 2 covers all 2 steps: no step is timed" in capsys.readouterr().out
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["runs"]["krona"]["reference"]["tokens_per_s"] != \
        report["runs"]["krona"]["reference"]["tokens_per_s"]  # nan: not timed


def test_demo_never_overwrites_files_it_did_not_write(tmp_path, capsys):
    # --out held the user's own demo.json / demo.png: they were silently overwritten
    (tmp_path / "demo.json").write_text('{"mine": 1}')
    (tmp_path / "demo.png").write_bytes(b"my plot")
    assert run_demo(TINY + ["--steps", "1", "--methods", "lora", "--out", str(tmp_path)]) == 2
    assert "not written by 'kfused demo'" in capsys.readouterr().err
    assert (tmp_path / "demo.json").read_text() == '{"mine": 1}'
    assert (tmp_path / "demo.png").read_bytes() == b"my plot"
    assert sorted(os.listdir(tmp_path)) == ["demo.json", "demo.png"]  # nothing trained/saved
    (tmp_path / "demo.json").unlink()  # a plot without a report beside it: not ours either
    assert run_demo(TINY + ["--steps", "1", "--methods", "lora", "--out", str(tmp_path)]) == 2
    assert (tmp_path / "demo.png").read_bytes() == b"my plot"
    # --out a file, or a symlinked report: a usage error before any training (was a
    # FileExistsError traceback after the frozen base's evaluation)
    assert run_demo(TINY + ["--out", str(tmp_path / "demo.png")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert run_demo(TINY + ["--out", str(tmp_path / "dangling")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / "demo.json").symlink_to(tmp_path / "demo.png")
    assert run_demo(TINY + ["--out", str(tmp_path / "link")]) == 2
    assert "not a regular file" in capsys.readouterr().err
    assert (tmp_path / "demo.png").read_bytes() == b"my plot"


def test_out_folders_that_cannot_be_written_are_refused_before_any_work(tmp_path, monkeypatch,
                                                                       capsys):
    # --out under a file (or in a folder that cannot be written): the demo failed with a
    # NotADirectoryError traceback after the frozen base's evaluation, pretrain_base after
    # the whole pretraining (its weights lost); --docs too few was a ValueError traceback
    import kfused.data.pretrain_base as pb
    from kfused.cli import demo

    def no_work(*a, **k):
        raise AssertionError("started working with an --out it cannot write")

    monkeypatch.setattr(demo, "_build_model", no_work)
    monkeypatch.setattr(pb, "build_model", no_work)
    (tmp_path / "file").write_text("mine")
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: os.fspath(p) != str(readonly)
                        and real_access(p, mode, **k))
    for out, text in [(tmp_path / "file" / "sub", "file is not a directory"),
                      (tmp_path / "file" / "a" / "b", "file is not a directory"),
                      (readonly / "new", "readonly is not writable"),
                      (readonly, "readonly is not writable"),
                      ("", "'' names no folder")]:  # was a FileNotFoundError traceback
        assert run_demo(TINY + ["--steps", "1", "--methods", "lora", "--out", str(out)]) == 2
        assert text in capsys.readouterr().err
        with pytest.raises(SystemExit) as exc:
            pb.main(["--steps", "1", "--docs", "40", "--seq-len", "32", "--out", str(out)])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "argument --out" in err and text in err, err
    assert (tmp_path / "file").read_text() == "mine" and os.listdir(readonly) == []
    with pytest.raises(SystemExit) as exc:
        pb.main(["--docs", "1", "--out", str(tmp_path / "base")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --docs 1 gives" in err and "Traceback" not in err
    assert not (tmp_path / "base").exists()


def test_demo_interrupted_write_keeps_the_earlier_files(tmp_path, monkeypatch):
    import types

    from kfused.cli import demo

    args = TINY + ["--steps", "1", "--methods", "krona", "--gen-examples", "0", "--out",
                   str(tmp_path)]
    assert run_demo(args) == 0
    before = {n: (tmp_path / n).read_bytes() for n in ("demo.json", "demo.png")}

    def partial(_report, f, **_):  # a kill in the middle of writing the report
        f.write('{"title": "kfused demo: par')
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "json", types.SimpleNamespace(load=json.load, dump=partial))
    with pytest.raises(KeyboardInterrupt):
        run_demo(args)
    monkeypatch.undo()
    assert (tmp_path / "demo.json").read_bytes() == before["demo.json"]  # whole, not partial

    def half_plot(_report, path):
        open(path, "wb").write(b"\x89PNG half")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_plot", half_plot)
    with pytest.raises(KeyboardInterrupt):
        run_demo(args)
    assert (tmp_path / "demo.png").read_bytes() == before["demo.png"]
    assert json.loads((tmp_path / "demo.json").read_text())["written_by"] == "kfused demo"
    assert sorted(os.listdir(tmp_path)) == ["adapter_krona", "demo.json", "demo.png"]


def test_demo_sentences_beyond_seq_len_are_not_trained_on_nor_scored_as_zero(tmp_path, capsys):
    import math

    # --seq-len 64 with --loss target: most training sentences start after byte 64, so a
    # batch of only those had no labelled token and its loss was nan (training on nan), and
    # the held-out loss over no token was reported as 0.000 (a perfect score)
    rc = run_demo(TINY + ["--steps", "3", "--methods", "lora", "--runs", "both", "--out",
                          str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "demo.json").read_text())
    for run in report["runs"]["lora"].values():
        assert all(math.isfinite(x) for x in run["losses"]), run["losses"]
    assert any("are left out (no target token)" in n for n in report["notes"])
    assert all(r["eval_loss"] != 0.0 for r in report["rows"])
    assert any("no held-out loss" in n for n in report["notes"])
    assert math.isfinite(report["fused_vs_reference"]["lora"]["max_abs_loss_difference"])
    # on the CPU the "fused" run is the reference path: the comparison says so (it read as
    # a fused-vs-reference result, a loss difference 0 and two tokens/s)
    assert report["fused_vs_reference"]["lora"]["fused_ran_reference_path"] is True
    assert "the fused run takes the reference path too" in out
    # nothing left to train on at all: a usage error before training
    assert run_demo(TINY + ["--seq-len", "40", "--out", str(tmp_path / "b")]) == 2
    assert "raise --seq-len or use --loss all" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_demo_runs_fused_and_distributed_messages(tmp_path, capsys):
    # --runs fused printed "fused run skipped: None"; --distributed without torchrun was a
    # RuntimeError traceback
    assert run_demo(TINY + ["--steps", "1", "--methods", "krona", "--runs", "fused",
                            "--gen-examples", "0", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "skipped: None" not in out and "reference run not requested (--runs fused)" in out
    for env in ("RANK", "WORLD_SIZE"):
        assert env not in os.environ
    assert run_demo(TINY + ["--distributed", "ddp", "--out", str(tmp_path / "d")]) == 2
    assert "needs the torchrun environment" in capsys.readouterr().err


def test_demo_model_dir_must_be_a_local_checkpoint(tmp_path, capsys):
    # a missing folder was taken for a model hub id (an OSError about repo ids); a folder
    # without config.json failed inside transformers
    # a checkpoint that is no causal LM (T5) or an unreadable config.json: a traceback from
    # transformers after the refusals (now a usage error too)
    import transformers

    transformers.T5Config(d_model=8, num_layers=1, num_heads=1).save_pretrained(tmp_path / "t5")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    for d, text in [(tmp_path / "missing", "no config.json"), (tmp_path, "no config.json"),
                    (tmp_path / "t5", "'t5' model, which is no causal language model"),
                    (tmp_path / "broken", "config.json cannot be read")]:
        with pytest.raises(SystemExit) as exc:
            run_demo(TINY + ["--model-dir", str(d), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "argument --model-dir" in err and text in err, err
    assert not (tmp_path / "out").exists()


def test_demo_rank_is_every_rows_rank_presets_included():
    # --rank ("rank r for every row") was ignored by a preset with per-projection ranks:
    # kernel-mix-qvo-intermediate kept its (3, 12) / (8, 8) pairs
    from kfused.cli.demo import _adapter_config
    from kfused.integration.headwise import headwise_config

    name = "kernel-mix-qvo-intermediate"
    cfg = _adapter_config(name, build_parser().parse_args(["--rank", "2"]), "reference")
    hw = headwise_config(cfg)
    assert (hw.q.wise, hw.q.shared, hw.o.wise, hw.o.shared, hw.v.lite) == (2, 2, 2, 2, 2)
    kept = _adapter_config(name, build_parser().parse_args([]), "reference")
    assert kept.ranks == {"q": (3, 12), "v": (8, 8), "o": (8, 8)}


def test_demo_help_documents_every_option():
    for action in build_parser()._actions:
        assert action.help and action.help.strip(), action.option_strings


# ------------------------------------------------------------------------------------------
# the shipped base


def test_pretrained_base_ships_and_matches_its_record():
    import transformers

    from kfused.data.pretrain_base import SHAPE, encode_documents, mean_loss
    from kfused.data import ByteTokenizer

    weights = os.path.join(BASE_DIR, "model.safetensors")
    assert os.path.getsize(weights) < 4 * 2**20
    info = json.load(open(os.path.join(BASE_DIR, "pretrain.json")))
    assert info["train_seconds"] > 0 and info["shape"] == SHAPE
    model = transformers.AutoModelForCausalLM.from_pretrained(
        BASE_DIR, attn_implementation="eager").float()
    assert model.config.n_embd == SHAPE["d_model"] and model.config.vocab_size == 260
    # the recorded held-out loss is what the shipped weights give (nats/byte; uniform is 5.56)
    held = encode_documents(documents(400, seed=4321), ByteTokenizer())
    T = SHAPE["max_len"]
    held = held[: (held.numel() // T) * T].view(-1, T)
    loss = mean_loss(model, held[:32])
    assert abs(loss - info["heldout_loss_nats_per_byte_float16_weights"]) < 0.1
    assert loss < 2.5


def test_pretrained_base_copies_names_from_its_context():
    # the first shipped base (56 fixed venue names, no coined ones) copied no name it had not
    # memorised: adapted to the task it wrote pool-like or garbled names. The shipped base's
    # greedy descriptions of held-out notes state the record's (mostly coined) name in most of
    # them (0.787 in pretrain.json; the 3,000-step base 0.191), where a base that does not
    # copy scores near 0
    import transformers

    from kfused.data.pretrain_base import name_copy_rate

    info = json.load(open(os.path.join(BASE_DIR, "pretrain.json")))
    model = transformers.AutoModelForCausalLM.from_pretrained(BASE_DIR).float()
    rate = name_copy_rate(model, documents(120, seed=4321))
    assert rate == pytest.approx(info["heldout_note_name_copy_rate"], abs=0.05)  # 2 of ~47
    assert rate >= 0.5


def test_pretrain_script_runs(tmp_path):
    from kfused.data.pretrain_base import build_parser as pp, pretrain

    # the thread count conftest chose (1 while a background run holds a core; the script's
    # default 2 then took 170 s against 16 s)
    info = pretrain(pp().parse_args(["--steps", "2", "--docs", "40", "--batch-size", "2",
                                     "--seq-len", "64", "--out", str(tmp_path),
                                     "--threads", str(torch.get_num_threads())]))
    assert info["train_tokens"] == 2 * 2 * 64
    cfg = json.load(open(tmp_path / "config.json"))
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (257, 259, 256)
    assert (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--warmup", "0"], ["--seq-len", "500"],
                                 ["--seq-len", "1"], ["--batch-size", "0"], ["--docs", "0"],
                                 ["--threads", "0"], ["--lr", "nan"], ["--seed", "-1"]])
def test_pretrain_arguments_are_checked_before_anything_runs(bad, tmp_path, capsys):
    # --steps 0 saved the untrained weights, then failed (ZeroDivisionError) before writing
    # pretrain.json: with the default --out, the shipped base no longer matched its record;
    # --seq-len beyond the 384 positions failed inside the embedding (IndexError)
    from kfused.data.pretrain_base import build_parser as pp

    with pytest.raises(SystemExit) as exc:
        pp().parse_args(["--out", str(tmp_path / "base")] + bad)
    assert exc.value.code == 2 and f"argument {bad[0]}" in capsys.readouterr().err


def test_pretrain_refuses_a_corpus_shorter_than_one_sequence(tmp_path):
    from kfused.data.pretrain_base import build_parser as pp, pretrain

    with pytest.raises(ValueError, match="--docs 1 gives .* fewer than one --seq-len 384"):
        pretrain(pp().parse_args(["--docs", "1", "--out", str(tmp_path / "base")]))
    assert not (tmp_path / "base").exists()


def test_pretrain_never_overwrites_a_model_it_did_not_write(tmp_path):
    # --out naming the user's own model folder: its config.json and weights were replaced
    from kfused.data.pretrain_base import _out_refusal, build_parser as pp, pretrain

    (tmp_path / "config.json").write_text('{"model_type": "mine"}')
    (tmp_path / "model.safetensors").write_bytes(b"my weights")
    args = pp().parse_args(["--steps", "1", "--docs", "40", "--batch-size", "1", "--seq-len",
                            "32", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="did not write .* not overwriting them"):
        pretrain(args)
    assert (tmp_path / "config.json").read_text() == '{"model_type": "mine"}'
    assert (tmp_path / "model.safetensors").read_bytes() == b"my weights"
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    # a folder this script wrote (the shipped base's) or an empty one is taken
    assert _out_refusal(BASE_DIR) is None and _out_refusal(str(tmp_path / "new")) is None


def test_pretrain_interrupted_while_moving_in_keeps_one_whole_version(tmp_path, monkeypatch):
    # the four files were moved over the earlier ones one by one: a Ctrl-C after the weights
    # left new weights beside the earlier record (its hash not theirs); and a second run then
    # refuses weights its record does not name (a user's fine-tuned weights put there)
    import hashlib

    import kfused.data.pretrain_base as pb

    argv = ["--steps", "1", "--docs", "40", "--batch-size", "1", "--seq-len", "32",
            "--out", str(tmp_path), "--threads", str(torch.get_num_threads())]
    monkeypatch.setattr(pb, "mean_loss", lambda model, held: 0.0)   # not what is tested: fast
    monkeypatch.setattr(pb, "name_copy_rate", lambda model, docs: 0.0)
    pb.pretrain(pb.build_parser().parse_args(argv))
    before = {n: (tmp_path / n).read_bytes() for n in pb.OUTPUTS}
    real, hits = os.replace, []

    def replace(src, dst):
        if os.path.basename(dst) == "pretrain.json" and pb.STAGING in src and not hits:
            hits.append(dst)
            raise KeyboardInterrupt                  # Ctrl-C lands between the moves
        return real(src, dst)

    monkeypatch.setattr(pb.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        pb.pretrain(pb.build_parser().parse_args(argv + ["--seed", "1"]))
    monkeypatch.setattr(pb.os, "replace", real)
    assert hits and {n: (tmp_path / n).read_bytes() for n in pb.OUTPUTS} == before
    assert sorted(os.listdir(tmp_path)) == sorted(pb.OUTPUTS)
    (tmp_path / "model.safetensors").write_bytes(b"USER FINE-TUNED WEIGHTS")
    with pytest.raises(pb.Refusal, match="not the weights its pretrain.json records"):
        pb.pretrain(pb.build_parser().parse_args(argv))
    assert (tmp_path / "model.safetensors").read_bytes() == b"USER FINE-TUNED WEIGHTS"
    record = json.loads(before["pretrain.json"])
    assert record["weights_sha256"] == hashlib.sha256(before["model.safetensors"]).hexdigest()


def test_pretrain_failing_while_writing_leaves_the_earlier_version_whole(tmp_path, monkeypatch):
    # the weights were written over the earlier ones, then the record: a failure (or a kill)
    # between the two left new weights beside the old record (its sha256 no longer matched)
    import hashlib

    import kfused.data.pretrain_base as pb

    import shutil

    for n in pb.OUTPUTS:  # the earlier version: a copy of the shipped base (this script's)
        shutil.copy(os.path.join(BASE_DIR, n), tmp_path / n)
    before = {n: (tmp_path / n).read_bytes() for n in pb.OUTPUTS}
    argv = ["--steps", "1", "--docs", "40", "--batch-size", "1", "--seq-len", "32",
            "--out", str(tmp_path), "--threads", str(torch.get_num_threads())]
    real_sha, calls = pb.sha256_file, []

    def fail(*a, **k):
        calls.append(1)
        if len(calls) == 1:    # the --out check hashes the earlier weights: not the failure
            return real_sha(*a, **k)
        raise OSError("disk full")

    monkeypatch.setattr(pb, "mean_loss", lambda model, held: 0.0)  # not what is tested: fast
    monkeypatch.setattr(pb, "sha256_file", fail)
    with pytest.raises(OSError, match="disk full"):
        pb.pretrain(pb.build_parser().parse_args(argv))
    monkeypatch.undo()
    assert {n: (tmp_path / n).read_bytes() for n in pb.OUTPUTS} == before
    assert sorted(os.listdir(tmp_path)) == sorted(pb.OUTPUTS)  # no staging folder left
    record = json.loads(before["pretrain.json"])
    assert record["weights_sha256"] == hashlib.sha256(before["model.safetensors"]).hexdigest()


def test_pretraining_corpus_is_disjoint_from_the_task():
    docs = documents(3000)
    text = "\n".join(a + " " + b for a, b in docs)
    for name in NAMES + NEAR:  # no task venue or landmark name, in any case
        assert name.lower() not in text.lower(), name
    for v in VENUE_NAMES + LANDMARKS:
        assert not any(v.lower() in n.lower() or n.lower() in v.lower() for n in NAMES + NEAR)
    assert "[" not in text  # never the task's key[value] syntax
    refs = {e["ref"] for e in load_pairs()}
    assert not any(r in text for r in refs)


# ------------------------------------------------------------------------------------------
# metrics


def test_metrics_reference_sentences_score_perfectly():
    pairs = load_pairs()
    mrs, refs = [e["mr"] for e in pairs], [e["ref"] for e in pairs]
    s = em.score(mrs, refs, refs)
    assert s["slot_accuracy"] == 1.0 and s["all_slots"] == 1.0 and s["added_per_example"] == 0
    assert s["bleu"] > 99.9


def test_metrics_slot_rules():
    mr = "name[Cotto], eatType[pub], food[fast food], familyFriendly[no], near[Burger King]"
    good = "Cotto is a pub serving fast food near Burger King. It is not family friendly."
    assert em.slot_scores([mr], [good])["slot_accuracy"] == 1.0
    # a negation flips familyFriendly; a missing value is not realised
    bad = "Cotto is a pub near Burger King. It is family friendly."
    s = em.slot_scores([mr], [bad])
    assert s["slot_accuracy"] == 3 / 5 and s["all_slots"] == 0.0
    # a stated value that the representation lacks is counted as added
    assert em.added_values(em.parse_mr(mr), "Cotto is an Italian pub in the riverside.") == \
        ["food[Italian]", "area[riverside]"]
    assert not em.slot_realised("eatType", "pub", "Cotto is public.")  # word boundaries
    # a value inside another slot's value: food[Indian] was realised by the landmark's name
    # alone, and Indian food beside that landmark was never counted as added
    mr = "name[Cotto], food[Indian], near[Raja Indian Cuisine]"
    assert em.slot_scores([mr], ["Cotto is near Raja Indian Cuisine."])["slot_accuracy"] == 2 / 3
    assert em.slot_scores([mr], ["Cotto serves Indian food near Raja Indian Cuisine."]) \
        ["slot_accuracy"] == 1.0
    mr = "name[Cotto], food[Italian], near[Raja Indian Cuisine]"
    assert em.added_values(em.parse_mr(mr), "Cotto serves Indian food near Raja Indian "
                                            "Cuisine.") == ["food[Indian]"]
    assert em.added_values(em.parse_mr(mr), "Cotto is near Raja Indian Cuisine.") == []


@pytest.mark.parametrize("module", ["make_e2e", "make_corpus"])
def test_data_scripts_answer_help_without_writing(module, capsys, monkeypatch):
    # `python -m kfused.data.make_e2e --help` rewrote the shipped e2e_tiny.jsonl
    import importlib

    mod = importlib.import_module(f"kfused.data.{module}")
    monkeypatch.setattr("builtins.open", None)           # nothing may be opened
    for argv, code in ((["--help"], 0), (["--bogus"], 2)):
        with pytest.raises(SystemExit) as exc:
            mod.main(argv)
        assert exc.value.code == code
    assert f"kfused.data.{module}" in capsys.readouterr().out


def test_make_e2e_replaces_the_data_set_whole(tmp_path, monkeypatch, capsys):
    # make_e2e wrote the shipped e2e_tiny.jsonl in place: a kill part way left a shorter data
    # set that the demo then loaded as the task
    from kfused.data import DATA_FILE, make_e2e

    monkeypatch.setattr(make_e2e, "__file__", str(tmp_path / "make_e2e.py"))
    target = tmp_path / "e2e_tiny.jsonl"
    target.write_text("the earlier set\n")
    real = make_e2e.generate

    def killed(*a, **k):
        yield from real(2)
        raise KeyboardInterrupt

    monkeypatch.setattr(make_e2e, "generate", killed)
    with pytest.raises(KeyboardInterrupt):
        make_e2e.main([])
    assert target.read_text() == "the earlier set\n"
    assert os.listdir(tmp_path) == ["e2e_tiny.jsonl"]  # no temporary file left
    monkeypatch.setattr(make_e2e, "generate", real)
    make_e2e.main([])
    with open(DATA_FILE, "rb") as f:  # reproducible: the shipped set, byte for byte
        assert target.read_bytes() == f.read()


def test_metrics_refuse_a_malformed_meaning_representation():
    # a key given twice kept its last value; text outside the slots was dropped
    with pytest.raises(ValueError, match="gives slot 'food' twice"):
        em.parse_mr("name[Cotto], food[Italian], food[French]")
    with pytest.raises(ValueError, match="found 'near Burger King' outside them"):
        em.parse_mr("name[Cotto], near Burger King")
    with pytest.raises(ValueError, match="gives slot 'name' twice"):
        em.slot_scores(["name[Cotto], name[Alimentum]"], ["Cotto."])
    assert em.parse_mr(" name[Cotto] ,food[fast food]") == {"name": "Cotto", "food": "fast food"}
    # no slot at all: the example counted as complete in all_slots (and its text as added)
    for mr in ("", " ", ","):
        with pytest.raises(ValueError, match="holds no key.value. slot"):
            em.slot_scores([mr, "name[Cotto]"], ["Cotto.", "Cotto."])


def test_metrics_refuse_mismatched_or_empty_lists():
    # a missing generation was silently dropped (zip): all_slots 0.5 for one realised example
    # of one, BLEU 0.0 instead of an error; empty lists failed inside sacrebleu (IndexError)
    mrs = ["name[Cotto], food[Italian]", "name[Alimentum]"]
    with pytest.raises(ValueError, match="2 mrs, 1 texts"):
        em.slot_scores(mrs, ["Cotto serves Italian food."])
    with pytest.raises(ValueError, match="2 mrs, 1 hyps, 2 refs"):
        em.score(mrs, ["Cotto serves Italian food."], ["Cotto is Italian.", "Alimentum."])
    with pytest.raises(ValueError, match="1 hyps, 2 refs"):
        em.bleu(["Cotto."], ["Cotto.", "Alimentum."])
    with pytest.raises(ValueError, match="no examples"):
        em.score([], [], [])
    # familyFriendly's value in either case; BLEU is sacrebleu's corpus BLEU on tiny examples
    assert not em.slot_realised("familyFriendly", "No", "Cotto is family friendly.")
    assert em.slot_realised("familyFriendly", "No", "Cotto is not family friendly.")
    assert em.bleu([""], ["Cotto is a pub."]) == 0.0
    assert em.bleu(["Cotto is a pub ."], ["Cotto is a pub."]) == pytest.approx(100.0)
    # case-sensitive: 4/5 unigrams, 3/4 bigrams, 2/3 trigrams, 1/2 4-grams, no brevity penalty
    assert em.bleu(["the café is a pub"], ["The café is a pub"]) == pytest.approx(
        100 * (4 / 5 * 3 / 4 * 2 / 3 * 1 / 2) ** 0.25)


def test_demo_fused_run_with_triton_kernels_in_the_interpreter(tmp_path, capsys):
    # issue 18 item 3 on a CPU: --fused-backend triton runs the fused Triton kernels (through
    # TRITON_INTERPRET=1) beside the unfused reference on identical batches, so the comparison
    # is a real one (before, the CPU's "fused" run was the reference path again)
    from kfused.backends import triton_interpret

    if not triton_interpret():
        pytest.skip("needs TRITON_INTERPRET=1 (the README's test command sets it)")
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    seen: Counter = Counter()

    class CountKfusedOps(TorchDispatchMode):  # which kfused custom ops actually ran
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func).startswith("kfused."):
                seen[str(func).split(".")[1]] += 1
            return func(*args, **(kwargs or {}))

    methods = "krona,kernel_mix,inducer_lora"
    # head width 32 (the inducer kernels' smallest); the loss on whole sequences, since few
    # sentences start within 64 bytes
    with CountKfusedOps():
        rc = run_demo(TINY + ["--d-model", "64", "--loss", "all", "--steps", "2", "--methods",
                              methods, "--runs", "both",
                              "--fused-backend", "triton", "--gen-examples", "1",
                              "--out", str(tmp_path)])
    assert rc == 0
    for op in ("krona_linear_triton_fwd", "krona_linear_triton_bwd", "headwise_qkv_triton_fwd",
               "headwise_qkv_triton_bwd", "headwise_oproj_triton_bwd",
               "inducer_attention_triton_fwd", "inducer_attention_triton_bwd"):
        assert seen[op] > 0, (op, dict(seen))  # the fused run ran the Triton kernels
    out = capsys.readouterr().out
    assert "ran the Triton kernels in their interpreter" in out
    report = json.loads((tmp_path / "demo.json").read_text())
    for m in methods.split(","):
        c = report["fused_vs_reference"][m]
        assert c["fused_ran_reference_path"] is False
        runs = report["runs"][m]
        assert runs["fused"]["backend"] == "triton" and runs["reference"]["backend"] == "reference"
        f, r = runs["fused"]["losses"], runs["reference"]["losses"]
        # the first loss is before any update: float32 kernels against the float32 reference
        assert abs(f[0] - r[0]) <= 1e-5 * abs(r[0]), (m, f, r)
        assert c["max_abs_loss_difference"] <= 1e-3 * max(map(abs, r)), (m, f, r)


@pytest.mark.parametrize("backend,text", [("cuda", "need a CUDA device"),
                                          ("triton", "TRITON_INTERPRET=1")])
def test_demo_fused_backend_that_cannot_run_is_a_usage_error(backend, text, tmp_path, capsys,
                                                              monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rc = run_demo(TINY + ["--steps", "1", "--methods", "krona", "--runs", "both",
                          "--fused-backend", backend, "--out", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"--fused-backend {backend}" in err and text in err, err
    assert not (tmp_path / "o").exists()  # refused before any work


def test_out_with_a_checkpoint_save_would_refuse_is_refused_before_any_work(
        tmp_path, monkeypatch, capsys):
    # adapter_<m>/ holding a kfused_checkpoint.json kfused did not write passed the --out
    # check: the run trained, then died in save() with a CheckpointError traceback
    from kfused.cli import demo

    def no_work(*a, **k):
        raise AssertionError("started working with an --out it cannot write")

    monkeypatch.setattr(demo, "_build_model", no_work)
    ckpt = tmp_path / "adapter_lora"
    ckpt.mkdir()
    (ckpt / "kfused_checkpoint.json").write_text('{"format": "not-kfused"}')
    assert run_demo(TINY + ["--steps", "1", "--methods", "lora", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "the lora adapter checkpoint: cannot save to" in err and "not written by kfused" in err
    assert (ckpt / "kfused_checkpoint.json").read_text() == '{"format": "not-kfused"}'
    assert sorted(os.listdir(tmp_path)) == ["adapter_lora"]
    (tmp_path / "adapter_krona").write_text("mine")  # a file where the checkpoint goes
    assert run_demo(TINY + ["--steps", "1", "--methods", "krona", "--out", str(tmp_path)]) == 2
    assert "adapter_krona: it exists and is a regular file" in capsys.readouterr().err


@pytest.mark.parametrize("methods", [",", "", " , "])
def test_methods_naming_no_method_is_a_usage_error(methods, tmp_path, capsys):
    # --methods ',' ran the frozen base alone and wrote a report with no adapter rows (exit 0)
    assert run_demo(TINY + ["--steps", "1", "--methods", methods, "--out",
                            str(tmp_path / "o")]) == 2
    assert "names no method" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_max_positions_of_a_model_numbering_positions_after_the_padding_index():
    # RoBERTa numbers positions from padding_idx + 1: --seq-len was cut to
    # max_position_embeddings, and the longest batch indexed past the position table
    from kfused.cli.demo import _max_positions
    from kfused.integration.models import tiny_model

    torch.manual_seed(0)
    rob = tiny_model("roberta", d_model=16, n_layers=1, n_heads=2, max_len=40).eval()
    n = _max_positions(rob)
    assert n == 40  # max_position_embeddings 42 - padding_idx 1 - 1
    with torch.no_grad():
        rob(input_ids=torch.randint(3, 100, (1, n)))
    assert _max_positions(tiny_model("gpt2", d_model=16, n_layers=1, n_heads=2,
                                     max_len=40)) == 40


def test_demo_comparison_line_with_no_timed_step_says_so(tmp_path, capsys):
    # --warmup covering every step times none: the fused-vs-reference line printed
    # "tokens/s nan vs nan"; it shows "-" as the table does, beside the note that says why
    rc = run_demo(TINY + ["--steps", "1", "--warmup", "1", "--loss", "all", "--methods", "lora",
                          "--runs", "both", "--gen-examples", "1", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "largest |fused - reference|" in ln)
    assert "nan" not in line and "tokens/s - vs -" in line, line
    assert "no step is timed (no tokens/s)" in out
