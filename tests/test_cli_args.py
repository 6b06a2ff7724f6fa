"""Bad command-line arguments are argparse usage errors (exit status 2, a message naming the
option and what it expects), never a traceback and never a run that ignores them; good ones
(the README's documented commands among them) still parse.

Everything runs in-process through ``kfused.cli.main.main`` and stops at argument parsing: a
fixture replaces the first heavy step of every command with an error, so a validator that let
a bad value through fails the test at once instead of starting a run. One subprocess test
covers the real entry point."""

import argparse
import math
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from kfused.cli import args as cli_args
from kfused.cli import bench, check, demo
from kfused.cli import main as cli_main
from kfused.cli import results as results_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_CUDA = not torch.cuda.is_available()
needs_no_cuda = pytest.mark.skipif(not NO_CUDA, reason="CUDA is available here")


class RanPastParsing(AssertionError):
    pass


@pytest.fixture
def no_run(monkeypatch):
    """Make the first step after argument parsing of each command fail loudly."""

    def boom(*a, **k):
        raise RanPastParsing("the command started running instead of refusing its arguments")

    monkeypatch.setattr(cli_main, "_info", boom)
    monkeypatch.setattr(cli_main, "_ensure_interpreter_on_cpu", boom)  # check: before re-exec
    monkeypatch.setattr(check, "run", boom)
    monkeypatch.setattr(bench, "environment", boom)
    monkeypatch.setattr(bench, "default_out_dir", boom)
    monkeypatch.setattr(demo, "_build_model", boom)
    monkeypatch.setattr(torch, "set_num_threads", boom)


def _usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "Traceback" not in err
    assert f"usage: kfused {argv[0]}" in err
    return err


# (argv, the option the message must name, more text it must contain)
POSITIVE_INT = [("demo", o) for o in ("--rank", "--layers", "--d-model", "--heads", "--seq-len",
                                      "--batch-size", "--steps", "--max-new-tokens", "--threads")]
NONNEGATIVE_INT = [("demo", o) for o in ("--warmup", "--gen-examples")]
POSITIVE_FLOAT = [("demo", "--lr"), ("bench", "--rep-ms")]

BAD = [
    (["info", "--bogus"], "--bogus", "unrecognized arguments"),
    (["info", "extra"], "extra", "unrecognized arguments"),
    (["check", "nosuchop"], "ops", "nosuchop"),
    (["check", "krona", "nosuchop"], "ops", "expected any of krona, headwise"),
    (["check", "--dtypes", ""], "--dtypes", "(none given)"),
    (["check", "--device", "bogus"], "--device", "invalid device 'bogus'"),
    (["check", "--device", ""], "--device", "invalid device"),
    (["check", "--device", "cuda:-1"], "--device", "invalid device"),
    (["check", "--device", "meta"], "--device", "not supported"),
    (["bench", "--device", "bogus"], "--device", "invalid device 'bogus'"),
    (["bench", "--device", "mps"], "--device", "not supported"),
    (["demo", "--device", "bogus"], "--device", "expected auto, cpu, cuda or cuda:N"),
    (["bench", "nosuchop"], "ops", "expected any of e2e"),
    (["demo", "--steps", "-1"], "--steps", "expected an integer >= 1, got '-1'"),
    (["demo", "--batch-size", "0"], "--batch-size", "expected an integer >= 1, got '0'"),
    (["bench", "--rep-ms", "-5"], "--rep-ms", "expected a number > 0, got '-5'"),
    (["demo", "--seed", "-1"], "--seed", "expected an integer in [0, "),
    (["demo", "--seed", str(2**64)], "--seed", "expected an integer in [0, "),
    (["demo", "--seed", "x"], "--seed", "expected an integer"),
    (["demo", "--scale", "nan"], "--scale", "expected a finite number"),
    (["demo", "--scale", "inf"], "--scale", "expected a finite number"),
    (["demo", "--scale", "big"], "--scale", "expected a number"),
    (["demo", "--base", "random", "--d-model", "130", "--heads", "4"], "--d-model",
     "not a multiple of --heads 4"),
    # each names the rows: the preset silently won over --method, either over --methods
    (["demo", "--method", "lora", "--preset", "lora-4"], "--preset",
     "not allowed with argument --method"),
    (["demo", "--methods", "lora,krona", "--method", "kernel_mix"], "--method",
     "not allowed with argument --methods"),
    (["demo", "--methods", "lora", "--preset", "lora-4"], "--preset",
     "not allowed with argument --methods"),
]
BAD += [([cmd, opt, v], opt, "expected an integer >= 1")
        for cmd, opt in POSITIVE_INT for v in ("0", "-3")]
BAD += [([cmd, opt, "2.5"], opt, "expected an integer, got '2.5'") for cmd, opt in POSITIVE_INT]
BAD += [([cmd, opt, "-1"], opt, "expected an integer >= 0") for cmd, opt in NONNEGATIVE_INT]
BAD += [([cmd, opt, v], opt, "expected a number > 0") for cmd, opt in POSITIVE_FLOAT
        for v in ("0", "-0.001")]
BAD += [([cmd, f"{opt}=-1e-3"], opt, "expected a number > 0") for cmd, opt in POSITIVE_FLOAT]
BAD += [([cmd, opt, v], opt, "expected a finite number") for cmd, opt in POSITIVE_FLOAT
        for v in ("nan", "inf")]
# a CUDA device where torch has none: refused up front, saying why
NO_CUDA_BAD = [([cmd, "--device", d], "--device", "torch.cuda.is_available() is False")
               for cmd in ("check", "bench", "demo") for d in ("cuda", "cuda:0")]
NO_CUDA_BAD += [(["bench", "--write-prefs", "prefs.json"], "--write-prefs", "needs a CUDA")]


def _id(case):
    return " ".join(case[0]) or "(empty)"


@pytest.mark.parametrize("argv,option,text", BAD, ids=[_id(c) for c in BAD])
def test_bad_arguments_are_usage_errors(argv, option, text, no_run, capsys):
    err = _usage_error(argv, capsys)
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"kfused {argv[0]}: error: ")
    assert option in last and text in last, last


@needs_no_cuda
@pytest.mark.parametrize("argv,option,text", NO_CUDA_BAD, ids=[_id(c) for c in NO_CUDA_BAD])
def test_cuda_device_without_cuda_is_a_usage_error(argv, option, text, no_run, capsys, tmp_path,
                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    last = _usage_error(argv, capsys).strip().splitlines()[-1]
    assert option in last and text in last, last


def test_info_help_prints_help_not_the_info(no_run, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["info", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kfused info") and "backends" in out


@pytest.mark.parametrize("cmd", ["check", "bench", "demo"])
def test_command_help_exits_0_without_running(cmd, no_run, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main.main([cmd, "--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: kfused {cmd}")


def test_bench_list_with_ops_is_refused(no_run, capsys):
    # it listed every op, exit 0, and ignored the ops given
    err = _usage_error(["bench", "--list", "nosuchop"], capsys)
    assert "argument --list" in err and "nosuchop" in err


def test_info_names_a_default_backend_every_call_would_refuse(monkeypatch, capsys):
    # KFUSED_BACKEND=bogus: info printed its tables, exit 0, and never said that every op
    # call without backend= raises
    monkeypatch.setenv("KFUSED_BACKEND", "bogus")
    assert cli_main.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "default backend: KFUSED_BACKEND='bogus' is not a backend" in out
    monkeypatch.delenv("KFUSED_BACKEND")
    assert cli_main.main(["info"]) == 0
    assert "default backend: auto (KFUSED_BACKEND)" in capsys.readouterr().out


def test_info_bogus_real_entry_point():
    out = subprocess.run([sys.executable, "-m", "kfused.cli.main", "info", "--bogus"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    assert "kfused info: error: unrecognized arguments: --bogus" in out.stderr
    assert "device:" not in out.stdout  # the info itself is not printed


# ------------------------------------------------------------------------------------------
# no bare int/float left: every numeric option of every parser goes through a validator


@pytest.mark.parametrize("parser", [demo.build_parser, bench.build_parser, check.build_parser,
                                    cli_main.info_parser])
def test_no_unvalidated_numeric_option(parser):
    bare = [a.option_strings for a in parser()._actions if a.type in (int, float)]
    assert not bare, f"numeric options without a validating type: {bare}"


def test_device_options_share_one_validator():
    def device_type(parser):
        return [a.type for a in parser._actions if a.dest == "device"]

    assert device_type(bench.build_parser()) == [cli_args.device]
    assert device_type(check.build_parser()) == [cli_args.device]
    assert device_type(demo.build_parser()) == [cli_args.device_or_auto]  # also takes "auto"


# ------------------------------------------------------------------------------------------
# good values still parse


@pytest.mark.parametrize("fn,text,value", [
    (cli_args.positive_int, "1", 1), (cli_args.positive_int, "48", 48),
    (cli_args.nonnegative_int, "0", 0), (cli_args.nonnegative_int, "7", 7),
    (cli_args.seed_int, "0", 0), (cli_args.seed_int, str(2**64 - 1), 2**64 - 1),
    (cli_args.positive_float, "1.2e-2", 1.2e-2), (cli_args.positive_float, "5", 5.0),
    (cli_args.nonnegative_float, "0", 0.0), (cli_args.finite_float, "-2.5", -2.5),
    (cli_args.device, "cpu", "cpu"), (cli_args.device, "cpu:0", "cpu:0"),
    (cli_args.device_or_auto, "auto", "auto"), (cli_args.device_or_auto, "cpu", "cpu"),
])
def test_validators_accept_good_values(fn, text, value):
    got = fn(text)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("fn,text", [
    (cli_args.positive_int, "0"), (cli_args.nonnegative_int, "-1"),
    (cli_args.positive_float, "0.0"), (cli_args.nonnegative_float, "-0.5"),
    (cli_args.nonnegative_float, "nan"), (cli_args.finite_float, "-inf"),
    (cli_args.device, "auto"), (cli_args.device, "CPU"),
])
def test_validators_refuse_bad_values(fn, text):
    with pytest.raises(argparse.ArgumentTypeError):
        fn(text)


@pytest.mark.skipif(NO_CUDA, reason="needs CUDA")
def test_cuda_devices_accepted_where_present():
    n = torch.cuda.device_count()
    assert cli_args.device("cuda") == "cuda"
    assert cli_args.device(f"cuda:{n - 1}") == f"cuda:{n - 1}"
    with pytest.raises(argparse.ArgumentTypeError, match="only"):
        cli_args.device(f"cuda:{n}")


def test_cuda_device_index_checked_against_device_count(monkeypatch):
    # the CUDA branch, on any machine: torch reports two devices
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cli_args.device("cuda") == "cuda" and cli_args.device("cuda:1") == "cuda:1"
    assert cli_args.device_or_auto("cuda:0") == "cuda:0"
    with pytest.raises(argparse.ArgumentTypeError, match=r"only 2 CUDA devices \(cuda:0 to"):
        cli_args.device("cuda:2")


def _readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("## Commands", 1)[1].split("\n## ", 1)[0]
    found = []
    for cmd, rest in re.findall(r"`kfused (\w+)([^`]*)`", section):
        rest = rest.replace("[ops]", "").replace("[", "").replace("]", "")
        if "--help" not in rest:
            found.append([cmd, *shlex.split(rest)])
    return found


def _demo_docstring_commands():
    lines = [ln.split("#")[0] for ln in (demo.__doc__ or "").splitlines()
             if "-m kfused.cli.demo" in ln]
    return [["demo", *shlex.split(ln.split("-m kfused.cli.demo", 1)[1])] for ln in lines]


PARSERS = {"demo": lambda a: demo.build_parser().parse_args(a),
           "bench": lambda a: bench.build_parser().parse_args(a),
           "check": check.parse_args,
           "info": lambda a: cli_main.info_parser().parse_args(a),
           "results": lambda a: results_cli.build_parser().parse_args(a)}


def test_readme_commands_still_parse():
    cmds = _readme_commands() + _demo_docstring_commands()
    names = {c[0] for c in cmds}
    assert {"demo", "check", "bench", "info", "results"} <= names, cmds
    assert ["bench", "--quick", "--dtype", "bf16"] in cmds
    for argv in cmds:
        if argv[0] == "perf":  # kfused.perf.report builds its parser inside run(): not parsed here
            continue
        assert PARSERS[argv[0]](argv[1:]) is not None, argv
    args = demo.build_parser().parse_args(["--steps", "200", "--lr", "3e-3", "--warmup", "0",
                                           "--gen-examples", "0", "--seed", "7", "--scale",
                                           "-0.5", "--threads", "2", "--device", "cpu"])
    assert (args.steps, args.lr, args.warmup, args.gen_examples, args.seed, args.scale,
            args.threads, args.device) == (200, 3e-3, 0, 0, 7, -0.5, 2, "cpu")
    assert math.isclose(bench.build_parser().parse_args(["--rep-ms", "0.5"]).rep_ms, 0.5)


def test_check_ops_by_op_or_family_name():
    args = check.parse_args(["inducer", "krona", "inducer_attention", "--dtypes", "fp32,float32"])
    assert args.ops == ["inducer_attention", "krona"]
    assert args.dtypes == [torch.float32]
    assert check.parse_args([]).ops == [] and check.parse_args([]).dtypes is None


def test_defaults_parse_for_every_command(no_run):
    assert demo.build_parser().parse_args([]).device == "auto"
    assert bench.build_parser().parse_args([]).device in ("cpu", "cuda")
    assert check.parse_args([]).device in ("cpu", "cuda")
    assert cli_main.info_parser().parse_args([]) == argparse.Namespace()


@pytest.mark.parametrize("argv,option", [(["--jobs", "0"], "--jobs"), (["--jobs", "-1"], "--jobs"),
                                         (["--arch", "abc"], "--arch"),
                                         (["--arch", "90,x"], "--arch"), (["--arch", ","], "--arch"),
                                         (["--arch", "86"], "--arch"),
                                         (["--arch", "90,75"], "--arch")])
def test_perf_options_are_checked(argv, option, monkeypatch, capsys):
    from kfused.perf import report

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # else run() re-launches itself
    monkeypatch.setattr(report, "analyse", lambda *a, **k: pytest.fail("ran with bad options"))
    with pytest.raises(SystemExit) as exc:
        report.run(argv)
    assert exc.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


def test_perf_refuses_before_the_compile_run(tmp_path, monkeypatch, capsys):
    # --update-known with --ops, --check without sm_90, an unknown op, a --json folder that does not exist or a
    # .txt name (the table beside it overwrote the JSON) were found only after the run, if at
    # all; the table's <name>.txt replaced any file of that name
    from kfused.perf import report

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # else run() re-launches itself
    monkeypatch.setattr(report, "analyse", lambda *a, **k: pytest.fail("ran with bad options"))
    (tmp_path / "r.txt").write_text("my notes")
    for argv, option, text in [
            (["--update-known", "--ops", "krona"], "--update-known", "needs a full run"),
            (["--update-known", "--arch", "80"], "--update-known", "needs a full run"),
            (["--check", "--arch", "80"], "--check", "--arch must include 90"),
            (["--arch", "80"], "--arch", "include 90, or pass --structure-only"),
            (["--ops", "krona,bogus"], "--ops", "bogus is no prefix of an op"),
            # no op named: it started the full compile run of every op
            (["--ops", ","], "--ops", "no op named"), (["--ops", ""], "--ops", "no op named"),
            (["--json", str(tmp_path / "no" / "r.json")], "--json", "does not exist"),
            (["--json", str(tmp_path)], "--json", "is a folder"),
            # an empty name (an unset variable) passed every check: nothing written after the run
            (["--json", ""], "--json", "names no file"),
            (["--json", str(tmp_path / "new") + os.sep], "--json", "names no file"),
            (["--json", str(tmp_path / "p.txt")], "--json", "give a .json name"),
            (["--json", str(tmp_path / "r.json")], "--json", "not overwriting it")]:
        with pytest.raises(SystemExit) as exc:
            report.run(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"argument {option}" in err and text in err, err
    assert (tmp_path / "r.txt").read_text() == "my notes"


def test_perf_default_report_is_never_a_file_it_did_not_write(tmp_path, monkeypatch, capsys):
    # without --json the default perf-latest.json / .txt were replaced whatever they held
    # (an installed package writes ./kfused_perf_results/); and a file that appears there
    # during the run is not replaced either: the report goes to a new name
    import json

    from kfused.perf import report

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # else run() re-launches itself
    default = tmp_path / "perf-latest.json"
    monkeypatch.setattr(report, "default_json", lambda: str(default))
    monkeypatch.setattr(report, "analyse", lambda *a, **k: pytest.fail("ran with bad options"))
    for name in ("perf-latest.json", "perf-latest.txt"):
        (tmp_path / name).write_text("USER")
        with pytest.raises(SystemExit) as exc:
            report.run(["--ops", "krona"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "argument --json: the default report" in err, err
        assert (tmp_path / name).read_text() == "USER"
        (tmp_path / name).unlink()

    fake = {"label": report.LABEL, "versions": {}, "failures": [], "violations": [],
            "elapsed_s": 0.0}

    def analyse(*a, **k):
        default.write_text("USER")           # appears while the run goes on
        return dict(fake)

    monkeypatch.setattr(report, "analyse", analyse)
    monkeypatch.setattr(report, "table", lambda rep: "TABLE")
    assert report.run(["--ops", "krona"]) == 0
    assert default.read_text() == "USER"
    assert json.loads((tmp_path / "perf-latest-2.json").read_text())["label"] == report.LABEL
    assert (tmp_path / "perf-latest-2.txt").read_text().startswith(report.LABEL)


def test_perf_json_is_never_a_file_it_did_not_write_and_is_replaced_whole(tmp_path, monkeypatch,
                                                                          capsys):
    # --json replaced any file of that name (only the table beside it was protected), and a
    # write that failed part way left a truncated report in place of the earlier one
    import json

    from kfused.perf import report

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # else run() re-launches itself
    label = "PREDICTED (static model, no GPU): kfused.perf"
    monkeypatch.setattr(report, "analyse", lambda *a, **k: dict(
        label=label, failures=[], violations=[], elapsed_s=1.0))
    mine = tmp_path / "mine.json"
    mine.write_text('{"my": "data"}')
    with pytest.raises(SystemExit) as exc:
        report.run(["--structure-only", "--json", str(mine)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --json" in err and "not overwriting it" in err, err
    assert mine.read_text() == '{"my": "data"}'
    ours = tmp_path / "ours.json"
    assert report.run(["--structure-only", "--json", str(ours)]) == 0
    assert report.run(["--structure-only", "--json", str(ours)]) == 0  # its own: replaced
    before = ours.read_text()
    assert json.loads(before)["label"] == label

    def fail_part_way(obj, f, **kw):
        f.write('{"label": ')
        raise OSError("disk full")

    monkeypatch.setattr(report.json, "dump", fail_part_way)
    with pytest.raises(OSError, match="disk full"):
        report.run(["--structure-only", "--json", str(ours)])
    assert ours.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.json", "ours.json"]


def test_perf_update_known_replaces_the_list_whole(tmp_path, monkeypatch):
    # write_known opened the committed known_violations.json for writing: a dump that failed
    # part way left it truncated
    from kfused.perf import report

    known = tmp_path / "known_violations.json"
    known.write_text('{"violations": []}\n')
    monkeypatch.setattr(report, "KNOWN", str(known))
    violation = {"arch": "sm_90", "where": "csrc/x.cu", "kernel": "k", "what": "spill", "value": 8}

    def fail_part_way(obj, f, **kw):
        f.write('{"about": ')
        raise OSError("disk full")

    monkeypatch.setattr(report.json, "dump", fail_part_way)
    with pytest.raises(OSError, match="disk full"):
        report.write_known({"versions": {}, "violations": [violation]})
    assert known.read_text() == '{"violations": []}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["known_violations.json"]
    monkeypatch.undo()
    monkeypatch.setattr(report, "KNOWN", str(known))
    report.write_known({"versions": {}, "violations": [violation]})
    assert report.load_known() == [violation]


def test_perf_update_known_writes_the_list_after_a_full_run(monkeypatch):
    # the full run's --update-known failed with NameError ('archs') after compiling everything
    from kfused.perf import report

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fake = {"failures": [], "elapsed_s": 1.0, "violations": [
        {"arch": "sm_90", "kernel": "k"}, {"arch": "sm_80", "kernel": "k"}]}
    monkeypatch.setattr(report, "analyse", lambda *a, **k: dict(fake))
    written = []
    monkeypatch.setattr(report, "write_known", written.append)
    assert report.run(["--structure-only", "--update-known"]) == 0
    assert [r["violations"] for r in written] == [[{"arch": "sm_90", "kernel": "k"}]]


def test_help_says_each_default_once():
    # "(default: each method's) (default: None)": argparse's defaults formatter appended its
    # own default after help text that already gave one, and "(default: None)" elsewhere
    from kfused.cli import demo
    from kfused.data import pretrain_base

    for parser in (demo.build_parser(), pretrain_base.build_parser()):
        text = " ".join(parser.format_help().split())
        assert "(default: None)" not in text
        assert "(default: 0)" in text                    # --seed's default is still shown
    demo_help = " ".join(demo.build_parser().format_help().split())
    assert "(default: each method's) --rank" in demo_help
    assert "(default: each row's, 8 for LoRA); KronA's factor shapes take the parameters of a " \
        "rank-r LoRA --scale" in demo_help


def test_perf_default_report_of_an_installed_package_goes_to_the_working_folder(tmp_path,
                                                                                monkeypatch):
    # an installed kfused (no checkout around it) wrote benchmarks/results/predicted/ into
    # site-packages, or failed there with PermissionError after the whole compile run
    from kfused.perf import report

    site = tmp_path / "site-packages"
    (site / "kfused").mkdir(parents=True)
    monkeypatch.setattr(report, "ROOT", str(site))
    monkeypatch.setattr(report, "OUT_DIR", str(site / "benchmarks" / "results" / "predicted"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # else run() re-launches itself
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    monkeypatch.setattr(report, "analyse", lambda *a, **k: dict(
        label=report.LABEL, versions={}, cases=[], failures=[], violations=[], elapsed_s=1.0))
    assert report.run([]) == 0
    assert sorted(p.name for p in site.iterdir()) == ["kfused"]
    out = work / "kfused_perf_results"
    assert sorted(p.name for p in out.iterdir()) == ["perf-latest.json", "perf-latest.txt"]
    # a checkout (benchmarks/ beside kfused/) keeps its committed folder
    (site / "benchmarks").mkdir()
    assert report.default_json() == str(site / "benchmarks" / "results" / "predicted"
                                         / "perf-latest.json")
