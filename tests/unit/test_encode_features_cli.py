"""`tessera encode-features` as a user meets it: one line a file written, a clear one-line
error (no traceback) for a bad input, and no two inputs written to one file."""

from __future__ import annotations

import json

import pytest

from bench.local_inputs import picture, png_bytes
from engine.tiny_model import make_tiny_model
from server.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("encode_cli"), seed=2)


def encode(capsys, *args) -> tuple[int, list[dict], str]:
    code = main(["encode-features", *map(str, args)])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def test_two_inputs_of_one_name_are_refused_before_anything_is_written(model_dir, tmp_path, capsys):
    """a/001.png and b/001.png were both written to OUT/001.safetensors (the second over
    the first), and both lines named that file: the first line then served b's features."""
    for folder, salt in (("a", 1), ("b", 2)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "001.png").write_bytes(png_bytes(picture(56, 56, salt)))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        encode(capsys, "--model", model_dir, "--output", out,
               tmp_path / "a/001.png", tmp_path / "b/001.png")  # fmt: skip
    captured = capsys.readouterr()
    assert exited.value.code == 2 and captured.out == "" and not out.exists()
    assert "001.safetensors" in captured.err and "Traceback" not in captured.err


def test_a_bad_input_is_one_line_and_the_files_before_it_exist(model_dir, tmp_path, capsys):
    """A corrupt image was a traceback, after a printed line whose file was never written
    (files were written only once every input had been encoded)."""
    good, bad = tmp_path / "good.png", tmp_path / "bad.png"
    good.write_bytes(png_bytes(picture(56, 56, 3)))
    bad.write_bytes(b"not an image")
    out = tmp_path / "out"
    code, lines, err = encode(capsys, "--model", model_dir, "--output", out, good, bad)
    assert code == 1 and "Traceback" not in err and "bad.png" in err
    # a local file is named by "path": the server takes no local path as a feature URL
    assert [line["path"] for line in lines] == [f"{out}/good.safetensors"]
    assert "url" not in lines[0]
    assert (out / "good.safetensors").is_file()


@pytest.mark.parametrize("args", [["missing.png"], ["--video-fps", "0", "x.png"],
                                  ["--max-video-frames", "0", "x.png"],
                                  ["--device", "garbage", "x.png"], ["--device", "tpu", "x.png"],
                                  ["--output", "s3://", "x.png"],
                                  ["--output", "s3:///", "x.png"]])  # fmt: skip
def test_bad_arguments_are_refused_before_the_model_loads(
    model_dir, tmp_path, capsys, args, monkeypatch
):
    """A bad --device raised with a traceback; `--output s3://` wrote to ./s3:/ and exited
    0 (fuzz34)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.png").write_bytes(png_bytes(picture(56, 56, 4)))
    args = [str(tmp_path / a) if a.endswith(".png") else a for a in args]
    with pytest.raises(SystemExit) as exited:
        main(["encode-features", "--model", str(model_dir), "--output", str(tmp_path / "o"), *args])
    assert exited.value.code == 2
    assert "Traceback" not in capsys.readouterr().err
    assert not (tmp_path / "s3:").exists()
