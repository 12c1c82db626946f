"""hf-arb buckets: bad values are argparse errors phrased in flags, never tracebacks."""

from __future__ import annotations

import pytest

from hf_arb.cli.app import main


@pytest.mark.parametrize("argv, message", [
    (["--resolution", "0"], "argument --resolution: must be a positive integer, got 0"),
    (["--step", "0"], "argument --step: must be a positive integer, got 0"),
    (["--resolution", "abc"], "argument --resolution: expected a positive integer, got 'abc'"),
    (["--max-aspect-error", "-1"], "argument --max-aspect-error: must be a finite number >= 0, got -1"),
    (["--max-aspect-error", "nan"], "argument --max-aspect-error: must be a finite number >= 0, got nan"),
    (["--resolution", "16"], "--step (64) must not exceed --resolution (16)"),
    (["--scheduler", "missing-dir"], "--scheduler missing-dir: no scheduler_config.json there"),
    (["--resolution", "1048576"], "argument --resolution: --resolution 1048576 looks like a pixel count (1024²); "
                                  "pass the side, e.g. --resolution 1024"),
])
def test_bad_values_are_one_line_errors_in_flags(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["buckets", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err
    assert "`" not in err.splitlines()[-1], "Python parameter names leaked into the message"


def test_fixed_table_notes_ignored_resolution(capsys) -> None:
    assert main(["buckets", "--preset", "novelai", "--resolution", "1024"]) == 0
    assert "note:" in capsys.readouterr().out


@pytest.mark.parametrize("command, flag, twin", [
    (["buckets"], "--bucket_preset", "--preset"), (["buckets"], "--bucket_step", "--step"),
    (["annotate", "d", "--output-dir", "o"], "--image_column", "--image-column"),
    (["annotate", "d", "--output-dir", "o"], "--max_aspect_error", "--max-aspect-error")])
def test_unknown_flag_names_its_cli_twin(command, flag, twin, capsys):
    """A training-script spelling given to hf-arb names hf-arb's (issue 24, item 7), from the sub-command's parser."""
    from hf_arb.cli.app import main

    with pytest.raises(SystemExit) as exit_:
        main([*command, flag, "1"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and err.startswith(f"hf-arb {command[0]}: error: unrecognized arguments")
    assert err.endswith(f"({flag}: this command spells it {twin})")


def test_fit_with_fewer_buckets_than_asked_says_why(tmp_path, capsys) -> None:
    """issue 34: `hf-arb buckets --fit --n-buckets 2` on photos of one shape printed 1 bucket and no reason."""
    import datasets

    data = tmp_path / "sizes.parquet"
    datasets.Dataset.from_dict({"w": [4000] * 6, "h": [3000] * 6}).to_parquet(str(data))
    assert main(["buckets", "--fit", str(data), "--width-column", "w", "--height-column", "h", "--n-buckets", "2"]) == 0
    out = capsys.readouterr().out
    assert ": 1 bucket, mean crop" in out, out
    assert "1 bucket, not 2: more buckets would not lower the mean crop (all 6 sizes have one aspect ratio, 1.333 " \
        "w/h)." in out, out
