"""`trainpipe diagnose` on a folder that is not a run directory says so (exit 2), rather than "the run never started"."""

import json

import pytest

from trainpipe.cli import main
from trainpipe.errors import RunDirError
from trainpipe.report.diagnose import diagnose


def out(capsys) -> str:
    c = capsys.readouterr()
    return c.out + c.err


def test_an_empty_folder_is_not_a_run_dir(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path)]) == 2
    text = " ".join(out(capsys).split())
    assert "is not a trainpipe run directory" in text and "it is empty" in text
    assert "never started" not in text and "Traceback" not in text


def test_an_unrelated_folder_is_not_a_run_dir_and_names_what_it_holds(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "photos").mkdir()
    assert main(["diagnose", str(tmp_path), "--json"]) == 2
    text = " ".join(out(capsys).split())
    assert "is not a trainpipe run directory" in text and "notes.txt" in text and "photos" in text
    with pytest.raises(RunDirError, match="events.jsonl, config.resolved.yaml, .trainpipe-run"):
        diagnose(tmp_path)


def test_a_missing_folder_is_exit_2(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in out(capsys)


@pytest.mark.parametrize("marker", ["config.resolved.yaml", ".trainpipe-run", "events.jsonl"])
def test_a_run_that_wrote_its_folder_but_no_event_never_started(tmp_path, capsys, marker):
    (tmp_path / marker).write_text("{}\n" if marker != "events.jsonl" else "")
    assert main(["diagnose", str(tmp_path), "--json"]) == 0
    (f,) = json.loads(capsys.readouterr().out)
    assert f["kind"] == "never_started" and f["severity"] == "fatal"


def _finished_run(tmp_path, grad_norms, eval_losses, lr=1.0, slope=0.01):
    import yaml

    ev = [{"event": "run_started", "step": 0, "level": "info", "time": 0}, {"event": "training_started", "step": 0, "level": "info", "time": 1}]
    ev.append({"event": "run_finished", "step": len(grad_norms), "level": "info", "time": 2, "wall_seconds": 60})
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    rows = [{"step": i + 1, "loss": 2.0 - slope * i + 0.05 * (i % 2), "grad_norm": g} for i, g in enumerate(grad_norms)]
    every = max(1, len(grad_norms) // len(eval_losses))
    rows += [{"step": every * (i + 1), "eval_loss": v} for i, v in enumerate(eval_losses)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sorted(rows, key=lambda r: r["step"])))
    (tmp_path / "config.resolved.yaml").write_text(yaml.safe_dump({"training": {"learning_rate": lr, "max_grad_norm": 1.0}}))
    return tmp_path


def test_pre_clip_gradient_norms_far_above_the_clip_are_instability_not_ok(tmp_path):
    """Issue 24's LoRA run at lr 1.0: clipping kept it finite (no spike, no NaN) while pre-clip norms reached 6117 and the
    eval loss rose; it was "ok - finished normally". Read over the whole run it is unstable."""
    norms = [0.9, 1.4, 35.0, 6117.0, 480.0, 220.0, 95.0, 60.0, 140.0, 75.0, 55.0, 40.0]
    found = diagnose(_finished_run(tmp_path, norms, [1.91, 2.35, 2.31, 2.28]))
    (f,) = [f for f in found if f.kind == "gradient_instability"]
    assert "6117" in f.evidence and "step 4" in f.evidence and "1.9100" in f.evidence and "ok" not in [x.kind for x in found]
    assert f.settings == ["training.learning_rate"]


def test_an_eval_loss_that_ends_above_its_start_is_said(tmp_path):
    found = diagnose(_finished_run(tmp_path, [0.9] * 12, [1.90, 2.40, 2.30, 2.20], lr=2e-4, slope=-0.03))  # train loss rising a little too: not overfitting
    (f,) = [f for f in found if f.kind == "eval_rising"]
    assert "1.9000" in f.evidence and "2.2000" in f.evidence and "ok" not in [x.kind for x in found]


def test_a_healthy_run_is_still_ok(tmp_path):
    found = diagnose(_finished_run(tmp_path, [2.5, 1.8, 1.2, 0.9, 0.8, 0.7, 0.6, 0.6, 0.5, 0.5, 0.5, 0.4], [2.0, 1.8, 1.7, 1.65], lr=2e-4, slope=0.1))
    assert [f.kind for f in found] == ["ok"]


def _noisy_run(tmp_path, eval_losses):
    """A table's small-batch training curve: the loss falls, then its smoothed tail sits 22 % above its best point."""
    import yaml

    tmp_path.mkdir()

    ev = [{"event": "run_started", "step": 0, "level": "info", "time": 0}, {"event": "training_started", "step": 0, "level": "info", "time": 1},
          {"event": "run_finished", "step": 40, "level": "info", "time": 2, "wall_seconds": 60}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    loss = [0.7 - 0.016 * i for i in range(25)] + [0.42 + 0.03 * (i % 3) for i in range(15)]  # smoothed low 0.371 at step 26, tail 0.454
    rows = [{"step": i + 1, "loss": x, "grad_norm": 0.5} for i, x in enumerate(loss)]
    rows += [{"step": 8 * (i + 1), "eval_loss": v} for i, v in enumerate(eval_losses)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sorted(rows, key=lambda r: r["step"])))
    (tmp_path / "config.resolved.yaml").write_text(yaml.safe_dump({"training": {"learning_rate": 1e-3, "max_grad_norm": 1.0}}))
    return tmp_path


def test_a_noisy_train_loss_whose_eval_loss_kept_improving_is_not_instability(tmp_path):
    found = {f.kind: f for f in diagnose(_noisy_run(tmp_path / "a", [0.66, 0.55, 0.49, 0.44, 0.41]))}
    assert "instability" not in found and found["noisy_train_loss"].severity == "info"
    assert "0.4100 at step 40" in found["noisy_train_loss"].evidence
    # the same train curve with an eval loss that got worse after the train loss's best point is instability
    found = {f.kind for f in diagnose(_noisy_run(tmp_path / "b", [0.66, 0.55, 0.49, 0.58, 0.63]))}
    assert "instability" in found and "noisy_train_loss" not in found
    # an eval loss that fell during training but ends above the baseline's (measured before training) is no excuse either
    run = _noisy_run(tmp_path / "c", [0.66, 0.55, 0.49, 0.44, 0.41])
    (run / "summary.json").write_text(json.dumps({"baseline": {"loss": 0.35}, "final": {"loss": 0.41}}))
    found = {f.kind for f in diagnose(run)}
    assert "instability" in found and "noisy_train_loss" not in found
