"""A YAML config's size is bounded after its aliases are expanded, not only their count (issue 36).

One 1 MB anchor used 300 times stays under the alias cap but expands to 300 MB: `config show` and `run` refuse it with
one paragraph (exit 2), before anything is written, instead of writing a 301 MB `config.resolved.yaml`.
"""

import pytest

from trainpipe.cli import main


@pytest.mark.parametrize("command", [["config", "show"], ["run"]])
def test_a_large_anchor_used_300_times_is_refused(tmp_path, capsys, command):
    config = tmp_path / "bomb.yaml"
    config.write_text("name: &big " + "x" * (1 << 20) + "\nmodel: {name_or_path: m}\ntags: [" + ", ".join(["*big"] * 300) + "]\n"
                      f"output_dir: {tmp_path / 'run'}\n")
    assert main([*command, str(config)]) == 2
    printed = capsys.readouterr()
    text = " ".join((printed.out + printed.err).split())
    assert "bomb.yaml" in text and "16 MB of text" in text and "Traceback" not in text, text[-1000:]
    assert not (tmp_path / "run").exists()
