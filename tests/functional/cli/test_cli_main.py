"""The ``deepnvme`` entry point: subcommands, help, --version, ``python -m deepnvme``,
extension hook."""

from __future__ import annotations

import deepnvme
from deepnvme.cli import main as cli_main

COMMANDS = ("report", "bench", "tune", "generate")


def test_help_lists_subcommands(spawn) -> None:
    proc = spawn("--help")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    for name in COMMANDS:
        assert f"\n    {name} " in out, name


def test_version_prints_the_package_version(spawn) -> None:
    proc = spawn("--version")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out == f"deepnvme {deepnvme.__version__}\n"


def test_python_dash_m_deepnvme_is_the_cli(spawn, tmp_path) -> None:
    proc = spawn("--version", module="deepnvme")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out == f"deepnvme {deepnvme.__version__}\n", err
    proc = spawn("report", "--dir", str(tmp_path / "missing"), module="deepnvme")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "does not exist" in out, err  # main's code reaches the shell


def test_bare_command_prints_the_full_help_to_stderr_and_exits_2(spawn, run_cli,
                                                                  monkeypatch) -> None:
    """No subcommand is a usage error (argparse's convention): the whole help, listing every
    command, goes to stderr and the exit status is 2; stdout stays empty."""
    monkeypatch.setenv("COLUMNS", "100")
    code, out, err = run_cli()
    assert code == 2 and out == ""
    assert err == cli_main.build_parser().format_help()
    proc = spawn()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == "" and "Traceback" not in err
    assert err.startswith("usage: deepnvme ")
    for name in COMMANDS:
        assert f"\n    {name} " in err, name


def test_a_registered_subcommand_is_dispatched(monkeypatch, capsys) -> None:
    def add_hello_parser(subparsers) -> None:
        p = subparsers.add_parser("hello")
        p.add_argument("--name", default="x")
        p.set_defaults(func=lambda args: print(f"hi {args.name}") or 3)

    monkeypatch.setattr(cli_main, "SUBCOMMANDS", [*cli_main.SUBCOMMANDS, add_hello_parser])
    assert cli_main.main(["hello", "--name", "y"]) == 3
    assert capsys.readouterr().out == "hi y\n"


def test_quick_start_command_parses() -> None:
    args = cli_main.build_parser().parse_args(["bench", "--io-size", "256M"])
    assert args.io_size == 256 << 20 and args.dir is None and args.loops == 3
